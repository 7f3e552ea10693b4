"""Exports to text-generation-webui (YAML) and llama.cpp (flags): exact text for hand-checkable
presets, valid syntax for every built-in, and the unmapped knobs named with a reason."""

from __future__ import annotations

import shlex

import pytest

from engine.config import DecodingConfig
from engine.interop import (
    TGW_PRIORITY, Note, effective_knobs, number, to_llama_cpp, to_textgen_webui,
)
from engine.presets import Preset, builtin_presets

yaml = pytest.importorskip("yaml")  # only to check our hand-written YAML parses (a transformers dependency)

# llama.cpp's canonical sampler names (common/sampling.cpp, common_sampler_types_from_names)
LLAMA_SAMPLERS = {"dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill",
                  "penalties", "adaptive_p"}


def preset(**knobs) -> Preset:
    return Preset.create("Test", "A test.", DecodingConfig(**knobs))


def keys(notes: tuple[Note, ...]) -> list[str]:
    return [n.key for n in notes]


def test_balanced_to_textgen_webui_exactly():
    out = to_textgen_webui(builtin_presets()["balanced"])
    assert out.text == (
        "# Balanced: exported from Decoding Playground\n"
        "# A common default: mild temperature plus top-p trims the unreliable tail.\n"
        "temperature: 0.8\n"
        "top_p: 0.9\n"
    )
    assert out.unmapped == () and out.caveats == ()


def test_balanced_to_llama_cpp_exactly():
    out = to_llama_cpp(builtin_presets()["balanced"])
    assert out.text == '--samplers "temperature;top_p" --temp 0.8 --top-p 0.9 --seed 0 --n-predict 64'
    assert out.unmapped == () and keys(out.caveats) == ["seed"]


def test_greedy_exports():
    greedy = builtin_presets()["greedy"]
    assert yaml.safe_load(to_textgen_webui(greedy).text) == {"do_sample": False, "top_k": 1}
    assert to_llama_cpp(greedy).text == '--samplers "top_k" --top-k 1 --n-predict 64'
    # temperature 0 under sampling is greedy too; sampling-only stages are dropped, as the engine does
    cold = preset(temperature=0.0, top_p=0.5, repetition_penalty=1.3)
    assert to_llama_cpp(cold).text == ('--samplers "penalties;top_k" --repeat-penalty 1.3 --repeat-last-n -1 '
                                       "--top-k 1 --n-predict 64")
    assert yaml.safe_load(to_textgen_webui(cold).text) == {
        "do_sample": False, "top_k": 1, "repetition_penalty": 1.3, "repetition_penalty_range": 0}


def test_anti_repetition_penalties_and_unmapped_ngram():
    anti = builtin_presets()["anti-repetition"]
    flags = to_llama_cpp(anti)
    assert flags.text.startswith('--samplers "penalties;temperature;top_p" --frequency-penalty 0.5 '
                                 "--presence-penalty 0.5 --repeat-last-n -1 --temp 0.8 --top-p 0.95")
    assert keys(flags.unmapped) == ["no_repeat_ngram_size"]
    assert "prompt tokens too" in dict((n.key, n.reason) for n in flags.caveats)["frequency_penalty"]
    webui = yaml.safe_load(to_textgen_webui(anti).text)
    assert webui["no_repeat_ngram_size"] == 3 and webui["frequency_penalty"] == 0.5
    # our order differs from text-generation-webui's default, so the preset carries it
    assert webui["sampler_priority"].split("\n")[:5] == [
        "frequency_penalty", "presence_penalty", "no_repeat_ngram", "temperature", "top_p"]
    assert sorted(webui["sampler_priority"].split("\n")) == sorted(TGW_PRIORITY)


def test_stage_order_is_carried():
    swapped = preset(temperature=0.7, top_k=40, stage_order=["top_k", "temperature"])
    assert to_llama_cpp(swapped).text.startswith('--samplers "top_k;temperature" --top-k 40 --temp 0.7')
    assert yaml.safe_load(to_textgen_webui(swapped).text)["sampler_priority"].startswith("top_k\ntemperature\n")
    split = preset(repetition_penalty=1.2, presence_penalty=0.3,
                   stage_order=["repetition_penalty", "temperature", "presence_penalty"], temperature=0.9)
    assert "stage_order" in keys(to_llama_cpp(split).caveats)  # llama.cpp applies the penalties as one sampler


def test_epsilon_uses_webui_units_and_is_unmapped_in_llama_cpp():
    eps = preset(epsilon_cutoff=0.0003)
    assert yaml.safe_load(to_textgen_webui(eps).text)["epsilon_cutoff"] == pytest.approx(3.0)
    assert keys(to_llama_cpp(eps).unmapped) == ["epsilon_cutoff"]


def test_strategies_other_tools_lack_are_named():
    beam = to_llama_cpp(builtin_presets()["beam-4"])
    assert keys(beam.unmapped) == ["strategy", "num_beams"] and "top-k 1" in beam.text
    assert keys(to_textgen_webui(builtin_presets()["beam-4"]).unmapped) == ["strategy", "num_beams"]
    contrastive = builtin_presets()["contrastive-search"]
    assert yaml.safe_load(to_textgen_webui(contrastive).text) == {"do_sample": False, "top_k": 4, "penalty_alpha": 0.6}
    assert keys(to_llama_cpp(contrastive).unmapped) == ["strategy", "penalty_alpha", "top_k"]
    cd = to_llama_cpp(preset(strategy="contrastive_decoding", cd_alpha=0.2))
    assert keys(cd.unmapped) == ["strategy", "cd_alpha", "amateur"]


def test_speculative_exports():
    ngram = to_llama_cpp(builtin_presets()["speculative-ngram"])
    assert ngram.text.endswith("--spec-type ngram-simple --spec-ngram-size-n 3 --spec-ngram-size-m 4 --draft-max 4")
    assert ngram.unmapped == ()
    self_int8 = to_llama_cpp(builtin_presets()["speculative-self-int8"])
    assert self_int8.text.endswith("--draft-max 4")
    assert "Q8_0 GGUF of the same model" in self_int8.unmapped[0].reason
    webui = to_textgen_webui(builtin_presets()["speculative-self-int8"])
    assert keys(webui.unmapped) == ["drafter", "num_draft_tokens"]


def test_words_stop_seed_and_trace_knobs():
    p = preset(temperature=0.9, banned_words=["foo"], stop=["\n\nUser:", "it's"], seed=5, top_n=20, max_new_tokens=10)
    flags = to_llama_cpp(p)
    assert keys(flags.unmapped) == ["top_n", "banned_words"]
    argv = shlex.split(flags.text)  # stop strings are shell-quoted
    assert argv[argv.index("--seed") + 1] == "5" and argv[argv.index("--n-predict") + 1] == "10"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--reverse-prompt"] == ["\n\nUser:", "it's"]
    webui = to_textgen_webui(p)
    assert keys(webui.unmapped) == ["top_n", "banned_words", "seed", "max_new_tokens", "stop"]
    assert "it's" not in webui.text  # user strings never reach the YAML


@pytest.mark.parametrize("stem", list(builtin_presets()))
def test_every_builtin_exports_valid_syntax(stem):
    p = builtin_presets()[stem]
    webui = to_textgen_webui(p)
    data = yaml.safe_load(webui.text) or {}
    assert all(isinstance(v, (int, float, bool, str)) for v in data.values())
    argv = shlex.split(to_llama_cpp(p).text)
    assert argv[0] == "--samplers" and set(argv[1].split(";")) <= LLAMA_SAMPLERS
    flags = [a for a in argv if a.startswith("-")]
    assert len(flags) == len(set(flags)), "a flag given twice"
    for note in (*webui.unmapped, *webui.caveats, *to_llama_cpp(p).unmapped):
        assert note.key and note.reason


def test_hostile_name_stays_in_one_comment_line():
    p = Preset("x", "evil\ntemperature: 5\r\n# more", DecodingConfig())
    assert yaml.safe_load(to_textgen_webui(p).text) is None  # only comments: nothing injected


def test_number_format_reads_back_everywhere():
    assert [number(v) for v in (3, 0.8, 1e-05, 1.0, True)] == ["3", "0.8", "1.0e-05", "1.0", "true"]
    assert yaml.safe_load(f"x: {number(1e-05)}")["x"] == 1e-05


def test_effective_knobs():
    assert effective_knobs(DecodingConfig()) == []
    assert effective_knobs(DecodingConfig(strategy="greedy", temperature=0.5, num_beams=3)) == []
    assert effective_knobs(DecodingConfig(strategy="contrastive_search", top_k=4)) == ["top_k", "penalty_alpha"]
    assert effective_knobs(DecodingConfig(strategy="speculative", drafter="ngram")) == [
        "drafter", "num_draft_tokens", "ngram_size"]
