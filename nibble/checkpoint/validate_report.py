"""What a checkpoint check found: `Finding`s (severity, code, message, file, tensor) collected in a
`CheckpointReport` with per-code counts and facts about the checkpoint, and `render_report`, its plain text.

Separate from the checks (validate.py, validate_shards.py) so that a report can be built, serialized and
rendered (`nibble doctor` renders the dict form) without the code that produced it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ERROR, WARNING, INFO = "error", "warning", "info"
# Findings listed per code; the rest are counted, so a badly broken checkpoint still gives a readable report.
MAX_LISTED_PER_CODE = 12


@dataclass
class Finding:
    """One problem or fact: severity (error | warning | info), a short machine code, and where."""

    severity: str
    code: str
    message: str
    file: str | None = None
    tensor: str | None = None


@dataclass
class CheckpointReport:
    """Everything the check found. `ok` is False when any error was found; warnings do not count."""

    model_dir: str
    findings: list[Finding] = field(default_factory=list)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, severity: str, code: str, message: str, file: str | None = None,
            tensor: str | None = None) -> None:
        per_code = self.counts.setdefault(severity, {})
        per_code[code] = per_code.get(code, 0) + 1
        if per_code[code] <= MAX_LISTED_PER_CODE:
            self.findings.append(Finding(severity, code, message, file, tensor))

    def num(self, severity: str) -> int:
        return sum(self.counts.get(severity, {}).values())

    @property
    def ok(self) -> bool:
        return self.num(ERROR) == 0

    def codes(self, severity: str | None = None) -> set[str]:
        """Codes found (of one severity, or all)."""
        sev = [severity] if severity else list(self.counts)
        return {c for s in sev for c in self.counts.get(s, {})}

    def to_dict(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "ok": self.ok, "errors": self.num(ERROR),
                "warnings": self.num(WARNING), "counts": self.counts, "facts": self.facts,
                "findings": [asdict(f) for f in self.findings]}

    def render(self) -> str:
        return render_report(self.to_dict())


def render_report(d: dict[str, Any]) -> str:
    """Plain text of a `CheckpointReport.to_dict()`: facts, findings by severity, a one-line result."""
    f = d["facts"]
    lines = [f"checkpoint {d['model_dir']}"]
    if "architecture" in f:
        lines.append(f"  {f['architecture']}, {f.get('layout')} layout, {f.get('quantization')}")
    if "context" in f:
        lines.append(f"  context: {f['context']}")
    if "num_tensors" in f:
        lines.append(f"  {f.get('num_shards', 0)} shard(s), {f['num_tensors']} tensors, "
                     f"{f.get('total_bytes', 0) / 1e9:.3f} GB; skipped (vision/MTP): {f.get('skipped', 0)}")
        lines.append(f"  checked: {f.get('headers_checked', 0)} headers, {f.get('block_scales_read', 0)} block-"
                     f"scale tensors{' (sampled)' if f.get('sampled') else ''}, {f.get('scalars_read', 0)} "
                     f"scalar scales, {f.get('deep_tensors_read', 0)} weights read in full "
                     f"in {f.get('seconds', 0.0):.1f} s")
    for sev in (ERROR, WARNING, INFO):
        for item in (x for x in d["findings"] if x["severity"] == sev):
            lines.append(f"  {sev.upper():7} {item['code']}: {item['message']}")
        for code, n in sorted(d["counts"].get(sev, {}).items()):
            if n > MAX_LISTED_PER_CODE:
                lines.append(f"  {sev.upper():7} {code}: ... and {n - MAX_LISTED_PER_CODE} more")
    lines.append(f"  result: {'OK' if d['ok'] else 'FAILED'} ({d['errors']} errors, {d['warnings']} warnings)")
    return "\n".join(lines)
