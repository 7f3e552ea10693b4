"""The green-list watermark of Kirchenbauer et al. (ICML 2023) as a stage, and its green lists.

At every step a pseudo-random share γ of the vocabulary is "green", seeded from the tokens before
the step; the stage adds δ to the green tokens' logits, so the text it helps write holds more
green tokens than chance (γ of them), which a detector holding the same key counts
(``engine.reports.watermark``). Two seeding schemes, as transformers' ``WatermarkLogitsProcessor``
(generation/logits_process.py) and ``WatermarkDetector`` (generation/watermarking.py) have them,
hashed exactly as they do so both give the same green lists (tests/engine/test_watermark.py):

- ``lefthash`` (the paper's Algorithm 2): the seed is key × the previous token.
- ``selfhash`` (Algorithm 3): a candidate token is green when it is in the green list seeded from
  itself and the ``context`` − 1 tokens before it (the minimum of key · T[x] · T[candidate] over that
  window, T a fixed random table); only the 40 likeliest candidates are tried, as transformers does.

The green list is ``randperm(V)[:int(γ · V)]`` from a CPU generator seeded so: the same on any
hardware (transformers seeds its generator on the model's device; on CPU the two agree bit for bit).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence

import torch

from engine.numbers import percent
from engine.stages.spec import STEP_LIFT, Export, Interop, Knob, Served, StageSpec, param, register
from engine.stages.base import Stage, require

if TYPE_CHECKING:
    from engine.trace import StageTrace

DEFAULT_KEY = 15485863  # transformers' default hashing key (the millionth prime)
TABLE_SIZE = 1_000_003
SELFHASH_CANDIDATES = 40  # transformers' (and the original repository's) rejection-sampling budget
SCHEMES = ("lefthash", "selfhash")
SEED_MODULUS = 2**64 - 1


@functools.lru_cache(maxsize=4)
def fixed_table(key: int) -> torch.Tensor:
    """selfhash's fixed random table [TABLE_SIZE] for ``key`` (computed once per key)."""
    rng = torch.Generator(device="cpu")
    rng.manual_seed(key)
    return torch.randperm(TABLE_SIZE, generator=rng)


def green_seed(context: torch.Tensor, scheme: str, key: int, width: int) -> int:
    """The generator seed of the green list after ``context`` [S] (CPU ids; for selfhash the last one
    is the candidate itself), from its last ``width`` ids, as transformers' ``set_seed``."""
    window = context[-width:]
    if scheme == "selfhash":
        table = fixed_table(key)
        a = table[window % TABLE_SIZE] + 1
        b = table[window[-1] % TABLE_SIZE] + 1
        seed = int((key * a * b).min())  # int64 arithmetic, wrapping as transformers' does
    else:
        seed = key * int(window[-1])
    return seed % SEED_MODULUS


def green_permutation(context: torch.Tensor, vocab_size: int, scheme: str, key: int, width: int) -> torch.Tensor:
    """The vocabulary permuted by the generator seeded from ``context``; its first int(γ · V) ids
    are the green list."""
    rng = torch.Generator(device="cpu")
    rng.manual_seed(green_seed(context, scheme, key, width))
    return torch.randperm(vocab_size, generator=rng)


def green_ids(context: Sequence[int] | torch.Tensor, vocab_size: int, gamma: float, scheme: str = "lefthash",
              key: int = DEFAULT_KEY, width: int = 1) -> torch.Tensor:
    """The green list [int(γ · V)] seeded from ``context`` (ids before the scored token; for
    selfhash, ending with the scored token itself)."""
    ids = torch.as_tensor(context, dtype=torch.long).cpu()
    return green_permutation(ids, vocab_size, scheme, key, width)[: int(vocab_size * gamma)]


class Watermark(Stage):
    """logits + δ on the step's green tokens (a new tensor). Fewer ids than ``context`` before the
    step: unchanged (transformers skips seeding then). Its diagnostics: how many tokens it raised
    (row 0)."""

    name = "watermark"

    def __init__(self, watermark_delta: float, watermark_gamma: float = 0.25, watermark_seeding: str = "lefthash",
                 watermark_key: int = DEFAULT_KEY, watermark_context: int = 1):
        require(watermark_delta > 0, "watermark_delta", watermark_delta, "(0, 10] for a stage")
        require(0 < watermark_gamma < 1, "watermark_gamma", watermark_gamma, "(0, 1)")
        require(watermark_seeding in SCHEMES, "watermark_seeding", watermark_seeding, " | ".join(SCHEMES))
        require(watermark_context >= 1, "watermark_context", watermark_context, "integers >= 1")
        super().__init__(watermark_delta=watermark_delta, watermark_gamma=watermark_gamma,
                         watermark_seeding=watermark_seeding, watermark_key=watermark_key,
                         watermark_context=watermark_context)

    def apply(self, input_ids, logits):
        k = self.knobs
        delta, width = k["watermark_delta"], k["watermark_context"]
        out = logits.clone()
        if input_ids is None or input_ids.shape[-1] < width:
            return out, {"raised": 0}
        raised = []
        for b, row in enumerate(input_ids.cpu()):
            greens = self.greens(row, logits[b])
            out[b, greens.to(out.device)] += delta
            raised.append(len(greens))
        return out, {"raised": raised[0]}

    def greens(self, row: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The ids this step raises after ``row`` [S] (CPU) given the incoming ``scores`` [V]:
        lefthash's whole green list, or the selfhash candidates that are green under themselves."""
        k = self.knobs
        vocab, gamma, scheme = scores.shape[-1], k["watermark_gamma"], k["watermark_seeding"]
        size = int(vocab * gamma)
        if scheme == "lefthash":
            return green_permutation(row, vocab, scheme, k["watermark_key"], k["watermark_context"])[:size]
        _, order = scores.sort(dim=-1, descending=True)  # as transformers' _score_rejection_sampling
        picked = []
        for candidate in order[:SELFHASH_CANDIDATES].cpu():
            context = torch.cat([row, candidate[None]])
            perm = green_permutation(context, vocab, scheme, k["watermark_key"], k["watermark_context"])
            if bool((perm[:size] == candidate).any()):
                picked.append(int(candidate))
        return torch.tensor(picked, dtype=torch.long)


def _watermark_note(stage: StageTrace) -> str:
    raised = stage.params.get("raised")
    count = f"{raised:,}" if isinstance(raised, int) and not isinstance(raised, bool) else "its"
    return (f"watermark {param(stage, 'watermark_delta')}: +{param(stage, 'watermark_delta')} on {count} green tokens "
            f"({stage.params.get('watermark_seeding', 'lefthash')}, γ {param(stage, 'watermark_gamma')}); moved "
            f"{percent(stage.tv_distance)} of the mass")


register(StageSpec(
    "watermark", order=215, group="watermark", label="watermark",
    knobs=(Knob("watermark_delta", "float", 0.0, 0.0, 10.0, doc="Green-list watermark (Kirchenbauer et al. 2023): add "
                "δ to the step's green tokens' logits. 0 = off.", step=0.1),
           Knob("watermark_gamma", "float", 0.25, 0.0, 0.99, low_open=True, doc="Watermark: the green share γ of the "
                "vocabulary at each step.", step=0.05),
           Knob("watermark_seeding", "choice", "lefthash", choices=SCHEMES, doc="Watermark: lefthash seeds the green "
                "list from the previous token(s); selfhash also from the candidate itself (more robust, slower)."),
           Knob("watermark_key", "int", DEFAULT_KEY, 1, 2**32 - 1, doc="Watermark: the hashing key the detector must "
                "share (transformers' default 15485863).", step=1, widget="number"),
           Knob("watermark_context", "int", 1, 1, 8, doc="Watermark: how many previous tokens seed the green list "
                "(transformers' context_width).", step=1)),
    active=lambda c: c.watermark_delta > 0,
    build=lambda c, ctx: Watermark(c.watermark_delta, c.watermark_gamma, c.watermark_seeding, c.watermark_key,
                                   c.watermark_context),
    note=_watermark_note,
    heading=lambda s: f"watermark: +{param(s, 'watermark_delta')} on a γ {param(s, 'watermark_gamma')} green list",
    interop=Interop("WatermarkLogitsProcessor",
                    webui=Export(unmapped="text-generation-webui has no green-list watermark"),
                    llama=Export(unmapped="llama.cpp has no green-list watermark sampler"), export_all_knobs=True),
    oracle="tests/engine/test_watermark.py::test_green_lists_and_biased_logits_equal_transformers "
           "tests/engine/test_watermark.py::test_detector_equals_transformers",
    served=Served(step_caveats=(STEP_LIFT,)),
))
