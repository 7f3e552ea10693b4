"""Shared by the tests: what tests/engine/test_speculative.py and the tests beside it use."""

from __future__ import annotations

import dataclasses
import torch
from scipy.stats import chisquare
from engine.config import DecodingConfig
from engine.backends.local import LoadedModel
from engine.chain import Chain

__all__ = ['chi_square_p', 'exact_two_token_joint', 'wrap']


# --- helpers ----------------------------------------------------------------------------------
def wrap(model, like: LoadedModel, name: str, eos=(2,)) -> LoadedModel:
    return dataclasses.replace(like, name=name, model=model, eos_token_ids=tuple(eos), _token_text={})


def chi_square_p(t1, t2, joint) -> float:
    """p-value of observed (t1, t2) counts against joint [V, V]; cells expected < 5 are pooled."""
    v = joint.shape[0]
    observed = torch.bincount(t1 * v + t2, minlength=v * v).double()
    expected = joint.flatten().double() * len(t1)
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item() / exp[keep].sum().item()).pvalue)


def exact_two_token_joint(lm: LoadedModel, prompt_ids: list[int], config: DecodingConfig) -> torch.Tensor:
    """P(t1, t2) [V, V] under the target with the stage chain, by full forwards (no cache)."""
    chain = Chain.from_config(config, len(prompt_ids))

    def dist(ids):
        ids_t = torch.tensor([ids])
        with torch.no_grad():
            logits = lm.model(ids_t).logits[:, -1].float()
        return torch.softmax(chain(ids_t, logits)[0], dim=-1)

    p1 = dist(prompt_ids)
    return torch.stack([p1[t] * dist(prompt_ids + [t]) for t in range(p1.shape[0])])
