"""Tokenizers: the one interface the engine and the server use, and its two implementations.

- ``HFTokenizer``: transformers' tokenizer from an HF directory, or from a GGUF file's embedded vocabulary
  (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``).
- ``ByteTokenizer``: for random-weight presets, which have no vocabulary of their own.
- ``StreamDecoder``: text deltas token by token, never splitting a multi-byte character.
- ``load_tokenizer(source)``: picks one from a path, a .gguf file or ``"bytes"``.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from vtengine.config import ConfigError


class TokenizerError(ValueError):
    """A request the tokenizer cannot serve (e.g. a chat request when there is no chat template)."""


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_ids: list[int]        # any of these ends a sequence
    bos_token_id: int | None
    vocab_size: int                 # ids the tokenizer knows: [0, vocab_size); the model's may be larger (padding)
    chat_template: str | None

    def encode(self, text: str) -> list[int]:
        """Token ids for ``text``, with the model's BOS convention (BOS prepended only where the model wants it)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` ([{"role", "content"}]) rendered by the chat template; TokenizerError if
        there is none."""

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder": ...


class StreamDecoder:
    """Streaming detokenization: feed token ids as they are produced, get only the text they add.

    Decoding each token alone is wrong: a byte-level BPE token can end in the middle of a UTF-8 character, and a
    sentencepiece token's leading space depends on what precedes it. So (as vLLM does) decode the ids from
    ``prefix_offset`` on and compare with the already-emitted window ``[prefix_offset, read_offset)``: the
    difference is the new text. While the decoded text ends in U+FFFD (an incomplete character) nothing is emitted;
    ``finish()`` releases whatever is still held. The windows start at points where the text was complete, so
    for byte-level tokenizers the joined deltas equal ``decode(all ids)`` exactly.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0      # start of the window decoded for context
        self.read_offset = 0        # ids before this have been emitted as text
        self.text = ""              # everything emitted so far

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        seen = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if not final and (len(full) <= len(seen) or full.endswith("\ufffd")):
            return ""                # incomplete character, or a token with no text (yet)
        delta = full[len(seen):]
        # the window now starts where the emitted text ends cleanly
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def step(self, new_ids: int | Sequence[int]) -> str:
        """Append one id or several; return the text they complete (possibly "")."""
        self.ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """End of the sequence: return any held-back text (an incomplete character decodes as U+FFFD)."""
        return self._emit(final=True)


class _Base:
    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class ByteTokenizer(_Base):
    """UTF-8 bytes as tokens, for random-weight presets.

    Ids: 0 = pad, 1 = bos, 2 = eos, byte b = b + 3 (so bytes occupy 3..258). ``encode`` prepends bos. The model's
    vocab_size (at least 259) is taken as given: ids from 259 up exist in the model but mean nothing here and
    decode to "" (so do the special ids when ``skip_special_tokens``; otherwise they decode to <pad>/<s>/</s>).
    Invalid UTF-8 decodes with U+FFFD replacement. No chat template.
    """
    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    _SPECIAL_TEXT = {0: "<pad>", 1: "<s>", 2: "</s>"}

    def __init__(self, vocab_size: int = 259):
        if vocab_size < self.OFFSET + 256:
            raise ConfigError(f"ByteTokenizer needs vocab_size >= {self.OFFSET + 256} (3 specials + 256 bytes), "
                              f"got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.pad_token_id = self.PAD
        self.eos_token_ids = [self.EOS]
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return [self.BOS] + [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if self.OFFSET <= i < self.OFFSET + 256:
                buf.append(i - self.OFFSET)
            elif i in self._SPECIAL_TEXT and not skip_special_tokens:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                out.append(self._SPECIAL_TEXT[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        raise TokenizerError("this model has no chat template (a byte-level tokenizer for random-weight presets); "
                             "use /v1/completions with a text or token-id prompt")


class HFTokenizer(_Base):
    """A transformers tokenizer behind the ``Tokenizer`` interface.

    ``eos_token_ids`` joins the tokenizer's eos with the eos ids of config.json/generation_config.json (chat models
    often end a turn with a token that is not the tokenizer's eos)."""

    def __init__(self, hf_tokenizer, extra_eos_token_ids: Sequence[int] = ()):
        self.hf = hf_tokenizer
        eos = []
        for i in [hf_tokenizer.eos_token_id, *extra_eos_token_ids]:
            if i is not None and int(i) not in eos:
                eos.append(int(i))
        self.eos_token_ids = eos
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.vocab_size = len(hf_tokenizer)
        self.chat_template = hf_tokenizer.chat_template or None

    @classmethod
    def from_dir(cls, path: str | Path) -> "HFTokenizer":
        d = Path(path)
        if not d.is_dir():
            raise ConfigError(f"tokenizer directory {str(d)!r} does not exist")
        if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                               "vocab.json")):
            raise ConfigError(f"{str(d)!r} holds no tokenizer (tokenizer.json, tokenizer_config.json, "
                              f"tokenizer.model or vocab.json); random-weight models use the 'bytes' tokenizer")
        extra = []
        for name in ("generation_config.json", "config.json"):
            f = d / name
            if f.is_file():
                e = json.loads(f.read_text()).get("eos_token_id")
                extra += [] if e is None else ([e] if isinstance(e, int) else list(e))
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(str(d)), extra)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "HFTokenizer":
        """The vocabulary, merges, special tokens and chat template embedded in a GGUF file (converted by
        transformers; ~10 s for a 49k vocabulary, most of it reading the GGUF)."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"GGUF file {str(p)!r} does not exist")
        st = p.stat()
        return cls(_hf_from_gguf(str(p.resolve()), st.st_mtime_ns, st.st_size))

    def encode(self, text: str) -> list[int]:
        # add_special_tokens applies the tokenizer's own post-processor: BOS for Llama-2/3, nothing for SmolLM2/Qwen
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # no clean-up of spaces before punctuation: it would make decode(a + b) != decode(a) + decode(b)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer has no chat template; use /v1/completions")
        # render to text, then tokenize without adding specials: the template already wrote BOS/role markers
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(self.hf.encode(text, add_special_tokens=False))


@functools.lru_cache(maxsize=4)
def _hf_from_gguf(path: str, mtime_ns: int, size: int):
    """The conversion is slow and its result read-only, so engines in one process share it (keyed by the file's
    identity, so a replaced file is converted again)."""
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def load_tokenizer(source, *, vocab_size: int | None = None) -> Tokenizer:
    """A tokenizer from: an existing Tokenizer (returned as is), ``"bytes"`` (ByteTokenizer; ``vocab_size`` is the
    model's, default 259), a .gguf file, or an HF directory with tokenizer files."""
    if isinstance(source, (ByteTokenizer, HFTokenizer)):
        return source
    if source == "bytes":
        return ByteTokenizer(vocab_size or ByteTokenizer.OFFSET + 256)
    p = Path(source)
    if p.is_file() and p.suffix == ".gguf":
        return HFTokenizer.from_gguf(p)
    if p.is_dir():
        return HFTokenizer.from_dir(p)
    raise ConfigError(f"tokenizer source {str(source)!r} is not 'bytes', an existing .gguf file or an HF directory "
                      f"with tokenizer files")
