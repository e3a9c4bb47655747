"""LLMEngine's image and video front (a mixin): a request's raw images and videos turned into a prompt with each
placeholder expanded and preprocessed inputs (`prepare_media`), and an admitted request given its vision
inputs; image_requests.py does the work, this part turns its ValueErrors into RequestErrors."""

from __future__ import annotations

from typing import Any

from nibble.engine.config import EngineConfig
from nibble.engine.errors import RequestError
from nibble.engine.image_requests import ImageArg, ImageRequests, VideoArg
from nibble.engine.request import Request
from nibble.engine.tokenizer import Tokenizer
from nibble.models.mrope import MRopeParams
from nibble.models.multimodal import ImageInputs, VideoInputs


class VisionPrompts:
    """The image / video methods of LLMEngine (`images`: None for a model without a vision tower)."""

    images: ImageRequests | None
    tokenizer: Tokenizer | None
    config: EngineConfig

    def vision_token_ids(self) -> tuple[int, ...]:
        """The placeholder ids of images and videos (none for a model without a vision tower)."""
        mrope = self.mrope
        if mrope is None:
            return ()
        return (mrope.image_token_id,) + ((mrope.video_token_id,) if mrope.video_token_id is not None else ())

    @property
    def mrope(self) -> MRopeParams | None:
        """The checkpoint's M-RoPE settings when it takes image and video input, else None."""
        return self.images.mrope if self.images is not None else None

    def check_mm_counts(self, num_images: int, num_videos: int) -> None:
        """RequestError when a prompt holds more images or videos than --limit-mm-per-prompt allows."""
        for kind, count in (("image", num_images), ("video", num_videos)):
            limit = self.config.mm_limit(kind)
            if limit is not None and count > limit:
                raise RequestError(f"this server takes at most {limit} {kind}{'s' if limit != 1 else ''} per prompt "
                                   f"(--limit-mm-per-prompt), got {count}")

    def _attach_vision(self, req: Request, images: ImageArg | None, videos: VideoArg | None) -> None:
        if self.images is None:
            raise RequestError("this model has no vision tower: image and video input are not supported")
        try:
            # converted once here (a list of ProcessedImage is concatenated): attach takes them as they are
            image_inputs = ImageInputs.of(images) if images is not None else None
            video_inputs = VideoInputs.of(videos) if videos is not None else None
            self.check_mm_counts(image_inputs.num_images if image_inputs is not None else 0,
                                 video_inputs.num_videos if video_inputs is not None else 0)
            self.images.attach(req, image_inputs, video_inputs)
        except ValueError as exc:
            what = "videos" if images is None else "images" if videos is None else "images and videos"
            raise RequestError(f"{what}: {exc}") from None

    def expand_image_prompt(self, prompt_ids: list[int], images: ImageArg) -> list[int]:
        """The prompt with its one image placeholder per image (as the chat template writes them) repeated to
        each image's token count. RequestError on a count mismatch or a model without image input."""
        if self.images is None:
            raise RequestError("this model does not take image input")
        try:
            return self.images.expand_prompt(prompt_ids, images)
        except ValueError as exc:
            raise RequestError(f"images: {exc}") from None

    def expand_video_prompt(self, prompt_ids: list[int], videos: VideoArg) -> list[int]:
        """The prompt with its one video placeholder per video (as the chat template writes them) replaced by
        each temporal patch's timestamp text (`<1.2 seconds>`, tokenized with the engine's tokenizer) and
        placeholders. RequestError on a count mismatch, a model without video input or without a tokenizer."""
        if self.images is None:
            raise RequestError("this model does not take video input")
        if self.tokenizer is None:
            raise RequestError("videos: a video's frame timestamps are text, and this model has no tokenizer")
        tokenizer = self.tokenizer
        try:
            return self.images.expand_video_prompt(prompt_ids, videos,
                                                   lambda text: tokenizer.encode(text, add_special_tokens=False))
        except ValueError as exc:
            raise RequestError(f"videos: {exc}") from None

    def prepare_media(self, prompt: str | list[int], raw_images: list[Any], raw_videos: list[Any] | None = None
                      ) -> tuple[list[int], ImageInputs | None, VideoInputs | None]:
        """A prompt with one placeholder per image and per video (as the chat template writes them) and its raw
        images (PIL images, RGB arrays, data URLs, bytes) and videos (frames, (frames, metadata), encoded bytes,
        data URLs), each also as an http(s):// or file:// URL (fetched here under the config's media policy,
        blocking), as add_request takes them: token ids with each placeholder expanded, and the preprocessed
        images and videos (None when there are none). RequestError for a bad image, video or URL, or a model
        without a vision tower."""
        if self.images is None:
            kind = "image" if raw_images else "video"
            raise RequestError(f"this model does not take {kind} input (no vision tower loaded)")
        self.check_mm_counts(len(raw_images), len(raw_videos or ()))
        images = videos = None
        try:
            images = self.images.preprocess(raw_images) if raw_images else None
        except ValueError as exc:
            raise RequestError(f"images: {exc}") from None
        try:
            videos = self.images.preprocess_videos(raw_videos) if raw_videos else None
        except ValueError as exc:
            raise RequestError(f"videos: {exc}") from None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send token ids as the prompt")
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        if images is not None:
            ids = self.expand_image_prompt(ids, images)
        if videos is not None:
            ids = self.expand_video_prompt(ids, videos)
        # the prefix-cache keys, hashed here (cached on the inputs): off the engine thread in the server
        for inputs in (images, videos):
            if inputs is not None:
                _ = inputs.content_digests
        return ids, images, videos
