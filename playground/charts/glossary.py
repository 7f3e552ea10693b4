"""One-line plain-word explanations of the terms the charts show, for hovers and a glossary line.

Every chart that shows one of these terms takes its hover text from here, so a word means the same
thing on every tab. Units: log-probabilities, entropy, surprisal and KL are in nats (natural log),
as docs/api.md's trace JSON says. No gradio here.
"""

from __future__ import annotations

import html

TERMS: dict[str, str] = {
    "kept": "kept: how many tokens of the whole vocabulary still have a non-zero probability after this stage",
    "mass removed": "mass removed: the share of probability the tokens this stage cut had before it",
    "temperature": "temperature: divides the scores before softmax; above 1 flattens the distribution, below 1 sharpens it",
    "top-k": "top-k: keeps only the k most probable tokens",
    "top-p": "top-p (nucleus): keeps the most probable tokens until their probabilities add up to p",
    "min-p": "min-p: drops tokens less probable than min-p × the top token's probability",
    "typical_p": "typical_p: keeps the tokens whose surprisal is closest to the entropy (the 'typical' ones) up to mass p",
    "ε": "ε (epsilon cutoff): drops every token whose probability is below ε",
    "u": "u: the random number in [0, 1) the sampler drew; the token whose slice of the cumulative bar holds u is chosen",
    "entropy": "entropy: how spread out the distribution is, in nats (0 = one certain token; ln 2 ≈ 0.69 = a coin flip)",
    "surprisal": "surprisal: −ln p of the chosen token, in nats (0 = fully expected; 2.3 = a 1-in-10 pick)",
    "nats": "nats: information measured with the natural log (1 nat ≈ 1.44 bits)",
    "log-prob": "log-prob: ln p of a token (0 = certain; more negative = less likely), in nats",
    "perplexity": "perplexity: e^(−mean log-prob); roughly how many tokens the model was choosing between",
    "residual": "residual: normalise(max(0, p − q)), the target's probability the drafter under-proposed; "
                "a rejected draft is replaced by a token drawn from it",
    "p": "p: the target model's probability of a token",
    "q": "q: the drafter's probability of a token (an n-gram drafter proposes one token with q = 1)",
    "accept": "accept with min(1, p/q): the speculative rule that keeps the output distributed exactly as the target alone",
    "KL(p‖q)": "KL(p‖q): how far distribution q is from p, in nats (0 = identical)",
    "rep-4": "rep-4: the share of 4-token sequences in the output that already appeared earlier in it (0 = no repetition)",
    "distinct-1": "distinct-1: distinct tokens ÷ all tokens in the output (1 = no token repeated)",
    "distinct-2": "distinct-2: distinct pairs of consecutive tokens ÷ all pairs (1 = no pair repeated)",
    "teacher-forced": "teacher-forced: every variant reads the same fp32 text, so each step compares like with like",
    "free-running": "free-running: each variant continues its own greedy text, which may part from fp32's",
    "top-1 agreement": "top-1 agreement: steps (teacher-forced) where the variant's most likely token is fp32's",
    "length penalty": "length penalty: a hypothesis' score is its summed log-prob ÷ length^penalty; above 0 favours longer text",
}


def hover(term: str) -> str:
    """The one-line explanation of ``term`` (KeyError for a term with none: add it to TERMS)."""
    return TERMS[term]


def glossary_line(terms: list[str]) -> str:
    """Several terms' explanations joined into one line (plain text, for a caption)."""
    return " · ".join(TERMS[t] for t in terms)


def abbr(term: str, shown: str | None = None) -> str:
    """HTML: the term with its explanation as a hover (``<abbr title=...>``)."""
    return f'<abbr title="{html.escape(TERMS[term])}">{html.escape(shown or term)}</abbr>'
