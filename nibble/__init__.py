"""nibble: an inference server for NVFP4-quantized Mixture-of-Experts LLMs (Qwen3.5), kernels in Triton."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from nibble.engine.llm import LLM
    from nibble.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy so that `import nibble` (e.g. for the CLI's --help) does not pay for torch's import.
    if name == "LLM":
        from nibble.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nibble.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
