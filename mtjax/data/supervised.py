"""Chat and prompt-completion records as token documents with the targets of their loss.

    encode = Encoder(tokenizer, template, "chat", train_on="answers")
    ids, targets = encode({"messages": [...]})     # int64 [n], bool [n]

    chat               {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}
                       rendered with the checkpoint's chat template (mtjax.data.chat)
    prompt-completion  {"prompt": "...", "completion": "..."}: the text prompt + completion,
                       then EOS; or both lists of messages, rendered as one conversation

`targets[t]` says whether token t is trained on (predicted from the tokens before it in
the document). train_on="answers": the tokens that overlap an answer (an assistant
message's span, or the completion and its EOS); "all": every token. The first token of
a document has nothing before it and is never a target. Tokens are those of the whole
rendered text (as transformers tokenizes it), and a token counts when any of its
characters is in an answer, as transformers' assistant mask counts it.
"""

from __future__ import annotations

import numpy as np

from mtjax.data import chat
from mtjax.data.format import ROW_FORMATS, TRAIN_ON, DataError

COLUMNS = {"chat": ("messages",), "prompt-completion": ("prompt", "completion")}  # the fields a record needs


class Encoder:
    def __init__(self, tokenizer, template: chat.Template | None, format: str, train_on: str = "answers"):
        if format not in ROW_FORMATS:
            raise DataError(f"format {format!r} is not one of {', '.join(ROW_FORMATS)}")
        if train_on not in TRAIN_ON:
            raise DataError(f"train-on {train_on!r} is not one of {', '.join(TRAIN_ON)}")
        self.tok, self.template, self.format, self.train_on = tokenizer, template, format, train_on

    def __call__(self, record: dict) -> tuple[np.ndarray, np.ndarray]:
        if self.format == "chat":
            if "messages" not in record:
                raise DataError(f"has no `messages` field (has: {', '.join(list(record)[:8])})")
            text, spans = self._conversation(chat.check_messages(record["messages"]), 0)
            eos = []
        else:
            text, spans, eos = self._prompt_completion(record)
        ids, offsets = self.tok.encode_offsets(text)
        answer = np.zeros(len(ids) + len(eos), bool)
        for t, (lo, hi) in enumerate(offsets):
            answer[t] = any(lo < end and hi > start for start, end in spans)
        answer[len(ids):] = True  # the EOS closing a completion
        targets = np.ones_like(answer) if self.train_on == "all" else answer
        targets[:1] = False
        return np.asarray(ids + eos, np.int64), targets

    def _conversation(self, messages: list[dict], first: int) -> tuple[str, list[tuple[int, int]]]:
        if self.template is None:
            raise DataError("a conversation needs the tokenizer's chat template, and it has none")
        if self.train_on == "all":
            return self.template.render(messages), []
        return self.template.answer_spans(messages, first)

    def _prompt_completion(self, record: dict):
        missing = [k for k in ("prompt", "completion") if k not in record]
        if missing:
            raise DataError(f"has no {' or '.join(f'`{k}`' for k in missing)} field "
                            f"(has: {', '.join(list(record)[:8])})")
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):
            messages = chat.check_messages(prompt + completion)
            return *self._conversation(messages, len(prompt)), []
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise DataError(f"`{name}` is {type(value).__name__}; prompt and completion must both be "
                                "text or both lists of messages")
            if not value.strip():
                raise DataError(f"`{name}` is empty; fill it or remove the record")
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))], [self.tok.eos_id]
