from tiny_models import build_tokenizer

from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.sampling_params import SamplingParams


def _stream(tok, text, params=SamplingParams()):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], params)
    deltas = []
    for i, t in enumerate(ids):
        delta, hit = detok.update([t], finished=i == len(ids) - 1)
        deltas.append(delta)
        if hit:
            break
    return deltas, detok


def test_multibyte_characters_stream_whole():
    tok = build_tokenizer(300)
    text = "café 日本語 🙂 naïve"
    deltas, detok = _stream(tok, text)
    assert "".join(deltas) == text == detok.text
    # no delta ever carries a broken character
    assert all("\ufffd" not in d for d in deltas)
    # the emoji is 4 bytes: byte-level tokens hold it back until it is complete
    assert any(d == "" for d in deltas)


def test_stop_string_truncates_and_is_held_back():
    tok = build_tokenizer(300)
    deltas, detok = _stream(tok, "The quick brown fox jumps", SamplingParams(stop=["brown"]))
    assert detok.text == "The quick " and detok.stop_string == "brown"
    assert "".join(deltas) == "The quick "


def test_stop_string_included_when_asked():
    tok = build_tokenizer(300)
    _, detok = _stream(tok, "The quick brown fox", SamplingParams(stop=["quick"], include_stop_str_in_output=True))
    assert detok.text == "The quick"


def test_prompt_context_does_not_leak_into_output():
    tok = build_tokenizer(300)
    prompt = tok.encode("The quick")
    out = tok.encode(" brown fox")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    text = "".join(detok.update([t], i == len(out) - 1)[0] for i, t in enumerate(out))
    assert text == " brown fox"
