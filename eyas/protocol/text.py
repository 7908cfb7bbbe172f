"""The text of an answer, one rule for every place that turns tokens into text.

Terms:

- *complete text*: the text of a token sequence up to its last complete character. A token of a
  byte-level tokenizer may end inside a multi-byte UTF-8 character (an emoji, a CJK character, a
  combining accent's bytes); decoded alone, that partial character reads as U+FFFD. It is held back
  until a later token completes it, or until the answer ends (then it is sent as the tokenizer's own
  decode gives it).
- *window*: the tokens decoded together to find a step's new text, ``ids[prefix_offset:]``; the text
  of ``ids[prefix_offset:read_offset]`` (already sent) is subtracted from its decode. A window starts
  one step back, so that a tokenizer whose decode depends on the token before (SentencePiece's
  leading space) decodes it in context. The rule is vLLM's incremental detokenizer's.
- *stop string*: a string that ends the answer; the text is cut before its first occurrence, and a
  tail that may still grow into one is held back while the answer runs.

The text is a pure function of the token ids, one token at a time, whatever the chunks they arrive
in: the target's stop decision, the report's ``text``, the SSE deltas and the gRPC chunks all come
from :class:`AnswerText`, so a streamed answer adds up to the non-streamed one, character for
character, on every protocol.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"  # what a partial UTF-8 character decodes to


class Detokenizer:
    """A growing token sequence's complete text, a delta at a time (vLLM's offset rule)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window's first token
        self.read_offset = 0  # tokens whose text has been released
        self.text = ""  # the text released so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _step(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) <= len(prefix) or (window.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # nothing new, or a character still incomplete
        delta = window[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def push(self, ids) -> str:
        """Add tokens; -> the text they complete (possibly empty)."""
        out = []
        for t in ids:
            self.ids.append(int(t))
            out.append(self._step(final=False))
        return "".join(out)

    def finish(self) -> str:
        """The answer ended: -> whatever is still held back, as the tokenizer decodes it."""
        return self._step(final=True) if self.read_offset < len(self.ids) else ""


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's symbol for each byte, inverted (GPT-2's table: printable bytes stand for
    themselves, the others shift to code points from 256 up)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_table()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for (a byte-level BPE token may be part of a character, whose text
    alone reads U+FFFD): its byte-level symbols mapped back to bytes, else (a special token, another
    tokenizer's kind) its text's UTF-8."""
    symbols = tokenizer.convert_ids_to_tokens(int(token_id))
    if token_id in getattr(tokenizer, "all_special_ids", ()) or not all(c in _BYTE_OF_CHAR for c in symbols):
        return tokenizer.decode([int(token_id)]).encode("utf-8")
    return bytes(_BYTE_OF_CHAR[c] for c in symbols)


class AnswerText:
    """An answer's text as a client may see it: the complete text cut before the first stop string,
    released as deltas that never take anything back.

    ``push(ids)`` -> the new text a stream may send now (a tail that could still become a stop
    string is held back); ``finish()`` -> the rest, once the answer ended; ``stopped``: a stop string
    appeared (generation ends after the round that completed it). ``min_tokens`` (vLLM's): a stop
    string counts only where it ends in the text of the answer's token number ``min_tokens`` or later."""

    def __init__(self, tokenizer, stop=(), min_tokens: int = 0):
        self.detok = Detokenizer(tokenizer)
        self.stop = [s for s in stop if s]
        self.sent = 0  # characters of the complete text released
        self.stopped = False
        self.min_tokens = min_tokens
        # characters a stop string must end past: the text of the first min_tokens - 1 tokens (None
        # until they have all arrived: no stop string counts yet)
        self.free_from: int | None = 0 if min_tokens <= 1 else None

    def push(self, ids) -> str:
        ids = list(ids)
        if self.free_from is None:
            before = self.min_tokens - 1 - len(self.detok.ids)
            self.detok.push(ids[:before])
            if len(self.detok.ids) == self.min_tokens - 1:
                self.free_from = len(self.detok.text)
            ids = ids[before:]
        self.detok.push(ids)
        return self._release(final=False)

    def on_tokens(self, ids) -> bool:
        """The target's stop rule, as a decode loop's ``on_tokens``: push, then whether a stop string
        appeared (no decoding at all for an answer without stop strings)."""
        if not self.stop:
            return False
        self.push(ids)
        return self.stopped

    def finish(self) -> str:
        self.detok.finish()
        return self._release(final=True)

    @property
    def text(self) -> str:
        """The text released so far (all of it after :meth:`finish`)."""
        return self.detok.text[: self.sent]

    def _release(self, final: bool) -> str:
        full = self.detok.text
        cuts = []
        if self.free_from is not None:
            found = (full.find(s, max(self.free_from - len(s) + 1, 0)) for s in self.stop)
            cuts = [i for i in found if i >= 0]
        if cuts:
            self.stopped = True
            end = min(cuts)
        elif final:
            end = len(full)
        else:
            hold = max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
            end = len(full) - hold
        end = max(end, self.sent)  # a held-back tail never covers released text (see the stop rule above)
        delta = full[self.sent : end]
        self.sent = end
        return delta

    @classmethod
    def of(cls, tokenizer, ids, stop=(), min_tokens: int = 0) -> str:
        """The whole answer's text: what a stream of ``ids`` adds up to."""
        text = cls(tokenizer, stop, min_tokens)
        text.push(ids)
        text.finish()
        return text.text
