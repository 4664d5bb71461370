"""The layouts and frameworks of the OpenVLA step benchmark: a ``tp x pp x dp`` :class:`Layout`
and the frameworks that can run it. Both parallax's rows (``openvla_parallax``) and the runs
(``openvla_runs``) use it, so neither imports the other for it."""

from __future__ import annotations

import re
from dataclasses import dataclass

NATIVE = ("torch-single", "torch-ddp-zero", "torch-fsdp2", "torch-dtensor-tp", "torch-pipelining")
FRAMEWORKS = ("parallax", *NATIVE)
# the natives' forms (``--native-variants``): each ViT block and decoder layer compiled, or not
NATIVE_VARIANTS = ("compile", "eager")


@dataclass(frozen=True)
class Layout:
    """A ``tp x pp x dp`` layout; ``1gpu`` is the single-device one."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        parts = [f"{a}{n}" for a, n in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp)) if n > 1]
        return "".join(parts) or "1gpu"

    @classmethod
    def parse(cls, text: str) -> Layout:
        text = text.strip().lower()
        if text in ("1gpu", "1", "single"):
            return cls()
        pairs = re.findall(r"(tp|pp|dp)(\d+)", text)
        axes = [a for a, _ in pairs]
        if not pairs or "".join(a + n for a, n in pairs) != text or len(set(axes)) != len(axes):
            raise ValueError(f"layout {text!r}: write e.g. 1gpu, tp2, pp2, dp2, tp2pp2dp2")
        return cls(**{a: int(n) for a, n in pairs})

    def supports(self, framework: str) -> bool:
        """Whether ``framework`` can run this layout (the natives cover one axis each)."""
        if framework == "parallax":
            return True
        return {
            "torch-single": self.gpus == 1,
            "torch-ddp-zero": self.dp == self.gpus > 1,
            "torch-fsdp2": self.dp == self.gpus > 1,
            "torch-dtensor-tp": self.tp == self.gpus > 1,
            "torch-pipelining": self.pp == self.gpus > 1,
        }[framework]
