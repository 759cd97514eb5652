"""Tokenizers: round trips, streaming decode == full decode across multi-byte characters, SmolLM2's chat template,
the byte tokenizer's id layout."""
import json

import pytest

from vtengine.config import ConfigError
from vtengine.tokenizer import (ByteTokenizer, HFTokenizer, StreamDecoder, Tokenizer, TokenizerError,
                                load_tokenizer)

# accents, CJK (3-byte), emoji (4-byte, one with a ZWJ sequence), Greek, combining marks, newlines, tabs
TEXTS = [
    "The capital of Portugal is Lisbon.",
    "Héllo wörld — naïve café, Ελληνικά, Ünïcödé.",
    "日本語のテキストと中文字符。",
    "rocket 🚀 party 🎉 family 👨‍👩‍👧 done",
    "e\u0301 combining, tabs\tand\nnew lines\n\n  indented",
    "",
]


def stream(tok, ids, chunk=1):
    dec = tok.stream_decoder()
    parts = [dec.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    parts.append(dec.finish())
    return parts


@pytest.fixture(scope="module")
def smollm2_tok():
    from vtengine.models.loader import smollm2_gguf_path
    try:
        path = smollm2_gguf_path()
    except ConfigError as e:
        pytest.skip(str(e))
    return load_tokenizer(path)


# ---------------------------------------------------------------------------------------------------------------
# ByteTokenizer


def test_byte_tokenizer_layout():
    tok = ByteTokenizer(vocab_size=512)
    assert isinstance(tok, Tokenizer)
    assert tok.encode("A\u00e9") == [1, ord("A") + 3, 0xC3 + 3, 0xA9 + 3]
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1 and tok.vocab_size == 512
    # specials and ids above the byte range decode to nothing
    assert tok.decode([0, 1, 3 + ord("h"), 300, 511, 3 + ord("i"), 2]) == "hi"
    assert tok.decode([1, 3 + ord("h"), 2], skip_special_tokens=False) == "<s>h</s>"
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ConfigError, match="vocab_size >= 259"):
        ByteTokenizer(vocab_size=100)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip_and_stream(text):
    tok = ByteTokenizer(vocab_size=512)
    ids = tok.encode(text)
    assert ids[0] == 1 and len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    parts = stream(tok, ids)
    assert "".join(parts) == text
    # no part ever holds a broken character
    assert all("\ufffd" not in p for p in parts)


def test_stream_holds_incomplete_characters():
    tok = ByteTokenizer(vocab_size=259)
    dec = tok.stream_decoder()
    euro = [b + 3 for b in "€".encode("utf-8")]      # 3 bytes
    assert dec.step(euro[0]) == "" and dec.step(euro[1]) == ""
    assert dec.step(euro[2]) == "€"
    # a truncated character is released by finish() as U+FFFD, so joined text still equals the full decode
    assert dec.step(euro[0]) == ""
    assert dec.finish() == "\ufffd"
    assert dec.text == tok.decode(euro + euro[:1]) == "€\ufffd"


def test_load_tokenizer_sources(tmp_path):
    assert isinstance(load_tokenizer("bytes", vocab_size=300), ByteTokenizer)
    assert load_tokenizer("bytes", vocab_size=300).vocab_size == 300
    with pytest.raises(ConfigError, match="not 'bytes'"):
        load_tokenizer(tmp_path / "nothing-here")
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)


def test_hf_directory_tokenizer(tmp_path, smollm2_tok):
    # save SmolLM2's converted tokenizer as a plain HF directory and read it back through from_dir
    smollm2_tok.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == [2, 0]         # the tokenizer's eos first, then generation_config's extras
    for text in TEXTS:
        assert tok.encode(text) == smollm2_tok.encode(text)


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 (HF tokenizer from the GGUF)


def test_smollm2_tokenizer_basics(smollm2_tok):
    tok = smollm2_tok
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 49152 and tok.eos_token_ids == [2] and tok.bos_token_id == 1
    # SmolLM2 adds no BOS; these ids are the GPT-2-style BPE pieces of the prompt
    ids = tok.encode("The capital of Portugal is")
    assert ids[0] != tok.bos_token_id and len(ids) == 5
    assert tok.decode(ids) == "The capital of Portugal is"
    assert tok.decode([tok.encode(" Lisbon")[0]]).strip().startswith("Lis")


@pytest.mark.parametrize("chunk", [1, 3])
def test_smollm2_round_trip_and_stream(smollm2_tok, chunk):
    for text in TEXTS:
        ids = smollm2_tok.encode(text)
        assert smollm2_tok.decode(ids) == text
        parts = stream(smollm2_tok, ids, chunk)
        assert "".join(parts) == text, text
        assert all("\ufffd" not in p for p in parts)
    # the multi-byte texts really do split characters across tokens, or the streaming test proves nothing
    emoji = smollm2_tok.encode(TEXTS[3])
    assert any("\ufffd" in smollm2_tok.decode([i]) for i in emoji)


def test_smollm2_stream_skips_special_tokens(smollm2_tok):
    tok = smollm2_tok
    ids = tok.encode("Hi 🚀") + [2] + tok.encode(" there")
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "Hi 🚀 there"
    dec = StreamDecoder(tok, skip_special_tokens=False)
    text = "".join(dec.step(i) for i in ids) + dec.finish()
    assert text == tok.decode(ids, skip_special_tokens=False) == "Hi 🚀<|im_end|> there"


def test_smollm2_chat_template(smollm2_tok):
    tok = smollm2_tok
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    msgs = [{"role": "user", "content": "What is the capital of Portugal?"}]
    ids = tok.apply_chat_template(msgs)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")         # the template's default system turn
    assert "<|im_start|>user\nWhat is the capital of Portugal?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # role markers are single special tokens, not spelled out in pieces
    im_start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False)[-3:] == ids[-3:]
