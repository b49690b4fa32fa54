"""Tests for backend/detokenizer.py: incremental detokenization and stop strings.

Tokenizers are trained locally on a tiny made-up corpus (no hub access): a byte-level BPE
(GPT-2 / SmolLM2 style) and two SentencePiece-style BPEs with byte-fallback tokens (<0xE2> ...),
one with Llama-2's decoder chain and one with a Metaspace decoder. Expected text always comes
from ``tokenizer.decode`` on the whole output, never from the detokenizer itself.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from loom.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer  # noqa: E402
from loom.engine.sampling_params import SamplingParams  # noqa: E402

FFFD = "\ufffd"
REPO = Path(__file__).resolve().parents[1]
from harness.default_model import ensure_default_model  # noqa: E402

SMOLLM2_DIR = ensure_default_model(verbose=False)

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve façade, jalapeño, Ångström, Zürich, São Paulo.",
    "日本語のテキストです。東京は大きい都市です。中文文本测试。",
    "Emoji time 😀🎉🚀👍🏽 and flags 🇺🇸 and family 👨‍👩‍👧.",
    "Ελληνικά κείμενα και русский текст тоже.",
    "def foo(x):\n    return x * 2  # comment\n",
    "stop here ### then more text after the marker. abc abd abcd",
] * 20

# Characters that the small vocabularies mostly do not contain whole: they get split over tokens.
MULTIBYTE = (list("éèçñüßÅø€£¥中文字東京都日本語한국어ðŁ")
             + ["😀", "🎉", "🚀", "👍🏽", "🇺🇸", "👨‍👩‍👧", "🤖", "𝔘", "ﬁ", "\u0301"])
WORDS = ["hello", "world", "the", "fox", "dog", "stop", "abc", "ab", "x", "###", "café", "\n", "  ", "42", "."]


# ---------------------------------------------------------------------------------------- tokenizers
def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<tool>", special=False)])  # an added token that is *not* special
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|im_start|>")


def _sentencepiece_style(variant: str) -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral style: '▁' word prefix, BPE with byte fallback tokens <0x00>..<0xFF>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=400, limit_alphabet=70, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    d = json.loads(tok.to_str())
    pieces = [p for p, _ in sorted(d["model"]["vocab"].items(), key=lambda kv: kv[1])
              if p not in ("<unk>", "<s>", "</s>")]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    d["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True)
    for added in d["added_tokens"]:
        added["id"] = vocab[added["content"]]
    if variant == "llama2":  # HF's Llama-2 tokenizer.json (legacy): normalizer + Replace/ByteFallback/Fuse/Strip
        d["normalizer"] = json.loads(
            normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]).__getstate__())
        d["pre_tokenizer"] = None
        d["decoder"] = json.loads(decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        ).__getstate__())
    else:  # Metaspace pre-tokenizer and decoder (non-legacy converters)
        d["pre_tokenizer"] = json.loads(
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False).__getstate__())
        d["decoder"] = json.loads(decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]).__getstate__())
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(d)),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def byte_level():
    return _byte_level()


@pytest.fixture(scope="module", params=["byte_level", "llama2", "metaspace"])
def any_tok(request, byte_level):
    if request.param == "byte_level":
        return byte_level
    return _sentencepiece_style(request.param)


# ---------------------------------------------------------------------------------------- helpers
def _params(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def _chunks(ids: list[int], rng: random.Random, max_chunk: int = 4) -> list[list[int]]:
    """Random step sizes, including empty steps."""
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([0] + list(range(1, max_chunk + 1))) if max_chunk > 1 else 1
        out.append(ids[i:i + n])
        i += n
    return out or [[]]


def _stream(tok, steps: list[list[int]], params: SamplingParams, finish: bool = True):
    detok = IncrementalDetokenizer(tok, [1, 2, 3], params)
    deltas: list[DetokenizerDelta] = []
    for k, chunk in enumerate(steps):
        d = detok.step(chunk, finished=finish and k == len(steps) - 1)
        assert isinstance(d.text, str)
        deltas.append(d)
        if d.stopped:
            break
    return detok, deltas


def _text_tokens(tok, rng: random.Random, n_units: int) -> list[int]:
    parts = []
    for _ in range(n_units):
        parts.append(rng.choice(MULTIBYTE) if rng.random() < 0.4 else rng.choice(WORDS))
        if rng.random() < 0.5:
            parts.append(" ")
    return tok.encode("".join(parts), add_special_tokens=False)


def _special_ids(tok) -> list[int]:
    return sorted(i for i, t in tok.added_tokens_decoder.items() if t.special)


def _random_ids(tok, rng: random.Random, length: int) -> list[int]:
    """Random token sequences. Byte-level BPE: any ids at all (also invalid UTF-8 byte soups).
    SentencePiece style: pieces, specials and runs of byte tokens that spell valid characters
    (split over steps at random); the sequence may end with an incomplete character (flushed at
    finish). A byte run that turns invalid after valid characters is the documented exception
    (test_byte_fallback_run_turning_invalid), so it is not generated here."""
    vocab = len(tok)
    byte_ids = {tok.convert_tokens_to_ids(f"<0x{b:02X}>"): b for b in range(256)}
    byte_ids = {i: b for i, b in byte_ids.items() if i is not None and i != tok.unk_token_id}
    if not byte_ids:
        return [rng.randrange(vocab) for _ in range(length)]
    byte_of = {b: i for i, b in byte_ids.items()}
    specials = _special_ids(tok)
    others = [i for i in range(vocab) if i not in byte_ids and i not in specials]
    ids: list[int] = []
    while len(ids) < length:
        r = rng.random()
        if r < 0.65:
            ids.append(rng.choice(others))
        elif r < 0.72:
            ids.append(rng.choice(specials))
        else:
            ids.extend(byte_of[b] for b in rng.choice(MULTIBYTE).encode("utf-8"))
    if rng.random() < 0.3:  # an incomplete character at the end, in a byte run of its own
        ids.append(rng.choice(others))
        char = rng.choice([c for c in MULTIBYTE if len(c) == 1 and ord(c) > 0x7F])
        ids.extend(byte_of[b] for b in char.encode("utf-8")[:-1])
    return ids


def _known_text(tok, ids: list[int]) -> str:
    """Text of a valid-UTF-8 token sequence cut anywhere: drop the tokens of a trailing incomplete character."""
    while ids and tok.decode(ids).endswith(FFFD):
        ids = ids[:-1]
    return tok.decode(ids)


def _ref_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference semantics, char by char: the first stop string to complete wins (ties: the longest)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return (text[:end] if include else text[:end - len(s)]), s
    return text, None


# ---------------------------------------------------------------------------------------- detokenization
@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_match_full_decode(any_tok, skip):
    rng = random.Random(1234 + skip)
    held_for_utf8 = 0
    for trial in range(300):
        ids = _random_ids(any_tok, rng, rng.randint(1, 40))
        expected = any_tok.decode(ids, skip_special_tokens=skip)
        detok, deltas = _stream(any_tok, _chunks(ids, rng), _params(skip_special_tokens=skip))
        got = "".join(d.text for d in deltas)
        assert got == expected, (trial, ids)
        assert detok.output_text == expected
        assert not any(d.stopped for d in deltas)
        held_for_utf8 += sum(1 for d in deltas[:-1] if d.text == "")
    assert held_for_utf8 > 0  # the sequences did exercise holding back


def test_token_by_token_matches_full_decode(any_tok):
    """One token per step, the way an engine streams: also every prefix is a prefix of the final decode."""
    rng = random.Random(7)
    for _ in range(100):
        ids = _random_ids(any_tok, rng, rng.randint(1, 30))
        expected = any_tok.decode(ids, skip_special_tokens=True)
        detok = IncrementalDetokenizer(any_tok, [], _params())
        for k, t in enumerate(ids):
            detok.step([t], finished=k == len(ids) - 1)
            assert expected.startswith(detok.output_text)
        assert detok.output_text == expected


def test_split_multibyte_characters_never_emit_replacement_char(any_tok):
    rng = random.Random(99)
    split_tokens = 0
    for _ in range(150):
        ids = _text_tokens(any_tok, rng, rng.randint(1, 12))
        expected = any_tok.decode(ids, skip_special_tokens=True)
        assert FFFD not in expected
        split_tokens += sum(FFFD in any_tok.decode([t]) for t in ids)
        for steps in (_chunks(ids, rng, 1), _chunks(ids, rng, 3)):
            _, deltas = _stream(any_tok, steps, _params())
            assert all(FFFD not in d.text for d in deltas), [d.text for d in deltas]
            assert "".join(d.text for d in deltas) == expected
    assert split_tokens > 20  # characters really were split across tokens


def test_incomplete_character_flushed_at_finish(any_tok):
    ids = any_tok.encode("hi 🤖", add_special_tokens=False)
    # Drop trailing tokens until the text ends in an incomplete character.
    while ids and not any_tok.decode(ids).endswith(FFFD):
        ids = ids[:-1]
    assert ids, "could not build an incomplete character"
    detok = IncrementalDetokenizer(any_tok, [], _params())
    for t in ids:
        assert FFFD not in detok.step([t], finished=False).text
    assert not detok.output_text.endswith(FFFD)
    last = detok.step([], finished=True)
    assert last.text.endswith(FFFD)
    assert detok.output_text == any_tok.decode(ids)


@pytest.mark.parametrize("variant", ["llama2", "metaspace"])
def test_sentencepiece_leading_spaces(variant):
    tok = _sentencepiece_style(variant)
    text = "Hello world  the fox"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[0].startswith("▁")
    assert tok.decode(ids[1:2]) != " " + tok.decode(ids[1:2]).lstrip()  # alone, a piece loses its space
    _, deltas = _stream(tok, [[t] for t in ids], _params())
    assert "".join(d.text for d in deltas) == tok.decode(ids) == text
    assert not deltas[0].text.startswith(" ")


def test_skip_special_tokens_on_and_off(byte_level):
    tok = byte_level
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    tool = tok.convert_tokens_to_ids("<tool>")
    ids = [im_start] + enc("Hi 😀") + [im_end, tool] + enc(" 東京") + [tok.eos_token_id]
    outs = {}
    for skip in (True, False):
        for steps in ([[t] for t in ids], [ids]):
            _, deltas = _stream(tok, steps, _params(skip_special_tokens=skip))
            outs[skip] = "".join(d.text for d in deltas)
            assert outs[skip] == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in outs[False] and "<|im_end|>" not in outs[True]
    assert "<tool>" in outs[True]  # not a special token: never skipped


def test_special_tokens_between_split_character_bytes(byte_level):
    """With skip_special_tokens, a special token between the bytes of a character disappears."""
    tok = byte_level
    ids = tok.encode("🤖", add_special_tokens=False)
    assert len(ids) >= 2, "the test needs a character split over several byte-level tokens"
    ids = ids[:1] + [tok.convert_tokens_to_ids("<|im_end|>")] + ids[1:]
    for skip in (True, False):
        _, deltas = _stream(tok, [[t] for t in ids] + [[]], _params(skip_special_tokens=skip))
        assert "".join(d.text for d in deltas) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("variant", ["llama2", "metaspace"])
def test_byte_fallback_run_turning_invalid(variant):
    """Documented exception: decode() turns a whole run of <0xNN> tokens into U+FFFD when the run
    ends invalid, but the stream already sent the valid characters; it must not retract them, and
    must still flush the rest."""
    tok = _sentencepiece_style(variant)
    byte = lambda bs: [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in bs]  # noqa: E731
    word = tok.encode("hello", add_special_tokens=False)
    good, cut = byte("𝔘".encode()), byte("🤖".encode()[:-1])
    ids = word + good + cut
    assert tok.decode(ids) == tok.decode(word) + FFFD * 7  # the whole run is replaced
    detok, deltas = _stream(tok, [[t] for t in ids], _params())
    assert detok.output_text == tok.decode(word) + "𝔘" + tok.decode(cut)
    # A lone bad byte in the middle of text.
    ids = word + good + byte([0x80]) + tok.encode(" the", add_special_tokens=False)
    detok, deltas = _stream(tok, [[t] for t in ids], _params())
    assert detok.output_text.startswith(tok.decode(word) + "𝔘" + FFFD)
    assert detok.output_text.endswith("the")


class _CountingTokenizer:
    def __init__(self, tok):
        self._tok = tok
        self.calls: list[int] = []

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self._tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_work_per_step_does_not_grow_with_output(byte_level):
    rng = random.Random(3)
    ids = _text_tokens(byte_level, rng, 1500)
    counting = _CountingTokenizer(byte_level)
    detok = IncrementalDetokenizer(counting, [], _params(stop=["never appears in the text"]))
    for k, t in enumerate(ids):
        detok.step([t], finished=k == len(ids) - 1)
    assert len(ids) > 1000
    assert detok.output_text == byte_level.decode(ids)
    assert max(counting.calls) <= 16, max(counting.calls)
    assert len(counting.calls) <= 2 * len(ids) + 2

    # A long run of special tokens that are skipped must not grow the decode window either.
    im_end = byte_level.convert_tokens_to_ids("<|im_end|>")
    ids = byte_level.encode("start", add_special_tokens=False) + [im_end] * 500 + byte_level.encode(" end 😀")
    counting = _CountingTokenizer(byte_level)
    detok = IncrementalDetokenizer(counting, [], _params(skip_special_tokens=True))
    for k, t in enumerate(ids):
        detok.step([t], finished=k == len(ids) - 1)
    assert detok.output_text == byte_level.decode(ids, skip_special_tokens=True) == "start end 😀"
    assert max(counting.calls) <= 16, max(counting.calls)


# ---------------------------------------------------------------------------------------- stop strings
def _enc_pieces(tok, pieces: list[str]) -> list[list[int]]:
    """Encode pieces separately so that their boundaries are token boundaries (byte-level BPE)."""
    return [tok.encode(p, add_special_tokens=False) for p in pieces]


def _run_pieces(tok, pieces, finish=True, **params):
    steps = _enc_pieces(tok, pieces)
    full = tok.decode([t for s in steps for t in s])
    assert full == "".join(pieces)
    return _stream(tok, steps, _params(**params), finish=finish)


def test_stop_string_spanning_token_boundaries(byte_level):
    detok, deltas = _run_pieces(byte_level, ["hello a", "b", "c then more", " text"], stop=["abc"])
    assert deltas[-1].stopped and deltas[-1].stop_reason == "abc"
    assert len(deltas) == 3  # stopped on the step that completed it
    assert detok.output_text == "hello "
    # The "a" and "b" were held back, never shown.
    assert [d.text for d in deltas] == ["hello ", "", ""]


def test_stop_string_include_in_output(byte_level):
    detok, deltas = _run_pieces(byte_level, ["hello a", "b", "c then more"], stop=["abc"],
                                include_stop_str_in_output=True)
    assert deltas[-1].stopped and detok.output_text == "hello abc"
    # With the stop string included, nothing needs holding back.
    assert [d.text for d in deltas] == ["hello a", "b", "c"]


def test_stop_string_at_very_start(byte_level):
    detok, deltas = _run_pieces(byte_level, ["###", " rest"], stop=["###"])
    assert deltas[0].stopped and deltas[0].text == "" and detok.output_text == ""
    detok, deltas = _run_pieces(byte_level, ["#", "##", " rest"], stop=["###"], include_stop_str_in_output=True)
    assert deltas[-1].stopped and detok.output_text == "###"


def test_stop_string_repeated_first_occurrence_wins(byte_level):
    detok, deltas = _run_pieces(byte_level, ["one STOP two STOP three"], stop=["STOP"])
    assert deltas[0].stopped and detok.output_text == "one "


def test_overlapping_stop_strings(byte_level):
    # "ab" completes before "abc": it wins even though "abc" is listed first and both are in one step.
    detok, deltas = _run_pieces(byte_level, ["xxabcyy"], stop=["abc", "ab"])
    assert deltas[0].stop_reason == "ab" and detok.output_text == "xx"
    # Same end position: the longer one wins.
    detok, deltas = _run_pieces(byte_level, ["xxa", "bcyy"], stop=["bc", "abc"])
    assert deltas[-1].stop_reason == "abc" and detok.output_text == "xx"
    # "abc" vs "abd": "ab" held back until the next char decides.
    detok, deltas = _run_pieces(byte_level, ["xxab", "d", "yy"], stop=["abc", "abd"], include_stop_str_in_output=False)
    assert [d.text for d in deltas] == ["xx", ""] and deltas[-1].stop_reason == "abd"
    detok, deltas = _run_pieces(byte_level, ["xxab", "e", "yy"], stop=["abc", "abd"])
    assert [d.text for d in deltas] == ["xx", "abe", "yy"] and not detok.stopped
    # Self-overlapping stop string: "aab" inside "aaab".
    detok, deltas = _run_pieces(byte_level, ["a", "a", "a", "b", "z"], stop=["aab"])
    assert deltas[-1].stop_reason == "aab" and detok.output_text == "a"


def test_held_back_text_flushed_at_finish(byte_level):
    detok, deltas = _run_pieces(byte_level, ["hello ", "a", "b"], stop=["abc"])
    assert [d.text for d in deltas] == ["hello ", "", "ab"]
    assert not detok.stopped and detok.output_text == "hello ab"
    # Not finished yet: still held.
    detok, deltas = _run_pieces(byte_level, ["hello ", "a", "b"], finish=False, stop=["abc"])
    assert detok.output_text == "hello "
    assert detok.step([], finished=True).text == "ab"


def test_stop_string_inside_split_multibyte_character(byte_level):
    tok = byte_level
    text = "go 東京 now"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(FFFD in tok.decode([t]) for t in ids)
    detok, deltas = _stream(tok, [[t] for t in ids], _params(stop=["東京"]))
    assert deltas[-1].stopped and detok.output_text == "go "
    assert all(FFFD not in d.text for d in deltas)


def test_stop_string_on_special_token_text(byte_level):
    tok = byte_level
    ids = (tok.encode("answer", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
           + tok.encode(" junk"))
    detok, deltas = _stream(tok, [[t] for t in ids], _params(stop=["<|im_end|>"], skip_special_tokens=False))
    assert deltas[-1].stopped and detok.output_text == "answer"
    detok, deltas = _stream(tok, [[t] for t in ids], _params(stop=["<|im_end|>"], skip_special_tokens=True))
    assert not detok.stopped and detok.output_text == "answer junk"


def test_steps_after_stop_or_finish_are_empty(byte_level):
    detok, deltas = _run_pieces(byte_level, ["a STOP b"], finish=False, stop=["STOP"])
    assert deltas[0].stopped
    again = detok.step(byte_level.encode("more"), finished=True)
    assert again.text == "" and again.stopped and again.stop_reason == "STOP"
    assert detok.output_text == "a "
    detok = IncrementalDetokenizer(byte_level, [], _params())
    detok.step(byte_level.encode("done"), finished=True)
    assert detok.step(byte_level.encode("more"), finished=True).text == ""
    assert detok.output_text == "done"


def test_min_tokens_defers_stop_strings(byte_level):
    steps = _enc_pieces(byte_level, ["x", "STOP", "y", "z", "STOP", "w"])
    n_before_second = sum(len(s) for s in steps[:4])
    _, deltas = _stream(byte_level, steps, _params(stop=["STOP"], min_tokens=n_before_second, max_tokens=100))
    assert deltas[-1].stopped and "".join(d.text for d in deltas) == "xSTOPyz"
    _, deltas = _stream(byte_level, steps, _params(stop=["STOP"]))
    assert deltas[-1].stopped and "".join(d.text for d in deltas) == "x"


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_random_against_reference(any_tok, include):
    rng = random.Random(2024 + include)
    spanning = 0
    for trial in range(250):
        ids = _text_tokens(any_tok, rng, rng.randint(1, 15))
        text = any_tok.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if text and rng.random() < 0.75:
                a = rng.randrange(len(text))
                stops.append(text[a:a + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["zz", "q!", "😀x", "abc", "\n\n"]))
        stops = [s for s in stops if s]
        expected, reason = _ref_stop(text, stops, include)
        detok = IncrementalDetokenizer(any_tok, [], _params(stop=stops, include_stop_str_in_output=include))
        steps = _chunks(ids, rng, 3)
        stopped_at = None
        for k, chunk in enumerate(steps):
            d = detok.step(chunk, finished=k == len(steps) - 1)
            out = detok.output_text
            assert expected.startswith(out), (trial, stops, out, expected)  # never retracted
            if not include and not d.stopped and k < len(steps) - 1:
                # No visible text could still turn out to be the start of a stop string: no suffix of
                # the text decoded so far that starts inside the visible text begins a stop string.
                seen = _known_text(any_tok, [t for s in steps[:k + 1] for t in s])
                assert seen.startswith(out)
                assert not any(s.startswith(seen[i:]) for i in range(len(out)) for s in stops), (out, seen, stops)
            if d.stopped:
                stopped_at = k
                break
        assert detok.output_text == expected, (trial, text, stops)
        assert detok.stop_reason == reason
        if reason is not None:
            assert stopped_at is not None
            seen = any_tok.decode([t for s in steps[:stopped_at + 1] for t in s])
            assert _ref_stop(seen, stops, include)[1] == reason
            # Not detected late: no earlier step had decoded text (not waiting for the rest of a
            # character) containing a stop string.
            for k in range(stopped_at):
                before = any_tok.decode([t for s in steps[:k + 1] for t in s])
                assert before.endswith(FFFD) or _ref_stop(before, stops, include)[1] is None
            if len(ids) > 1 and any(len(s) > 1 for s in stops):
                spanning += 1
    assert spanning > 50


# ---------------------------------------------------------------------------------------- real tokenizer
def test_smollm2_tokenizer():
    # what AutoTokenizer resolves to, minus its import cost
    tok = PreTrainedTokenizerFast.from_pretrained(str(SMOLLM2_DIR))
    assert len(tok) > 40000
    rng = random.Random(5)
    for skip in (True, False):
        for _ in range(150):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
            _, deltas = _stream(tok, _chunks(ids, rng), _params(skip_special_tokens=skip))
            assert "".join(d.text for d in deltas) == tok.decode(ids, skip_special_tokens=skip)
    for _ in range(100):
        ids = _text_tokens(tok, rng, rng.randint(1, 12))
        _, deltas = _stream(tok, [[t] for t in ids], _params())
        assert all(FFFD not in d.text for d in deltas)
        assert "".join(d.text for d in deltas) == tok.decode(ids, skip_special_tokens=True)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi 😀"}], tokenize=False)
    ids = tok.encode(chat + "Sure! 東京 is<|im_end|>", add_special_tokens=False)
    _, deltas = _stream(tok, [[t] for t in ids], _params(stop=["東京"], skip_special_tokens=False))
    assert deltas[-1].stopped and "".join(d.text for d in deltas) == chat + "Sure! "
