"""`leantune chat`: an interactive chat in the terminal.

Each user line joins the conversation, which goes through the tokenizer's chat template (the
whole history every turn: multi-turn); the reply is printed token by token as it is generated
and joins the history. `/reset` starts a new conversation (keeping --system), `/exit` or end of
input (Ctrl-D) ends the chat; Ctrl-C ends it too, the CLI saying so in one line.

A model trained on alpaca prompts or plain text (`prompt_format` "alpaca" / "text": the run's
own format, prompts.trained_prompt_format) is asked in that format instead; those formats have
no turns, so each line is asked on its own (no history).

The conversation shares the model's context with the reply (generate/context.py): a reply that
would run past it stops there, said once, in a line after it (/reset to start over; not also
generate's note before it), and a message that leaves no room for one is left out of the
conversation with a line that says so (/reset to start over, or a shorter message), and the chat
goes on.
"""

from __future__ import annotations

import sys

from ..errors import LeantuneError
from .context import PromptTooLong, fit_to_context
from .prompts import DESCRIBE, prompt_ids, typed_prompt
from .text import MAX_NEW_TOKENS, generate

HELP = "/reset starts over, /exit (or Ctrl-D) ends"


class TextStreamer:
    """Writes a completion as its tokens arrive: decodes the ids so far and writes what is new,
    holding back a character whose bytes are not all there yet (byte-level tokens)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer = tokenizer
        self.out = out or sys.stdout
        self.ids: list[int] = []
        self.shown = 0  # characters written

    def put(self, ids: list[int]) -> None:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self._write(text)

    def end(self) -> None:
        self._write(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        self.out.write("\n")
        self.out.flush()
        self.ids, self.shown = [], 0

    def _write(self, text: str) -> None:
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)


def chat(model, tokenizer, *, system: str | None = None, read=None, out=None,
         prompt_format: str = "chat", **generate_kw) -> None:
    """Run the chat until /exit or end of input. `read(prompt)` (default `input`) returns the
    user's next line, raising EOFError at the end; `prompt_format`: "chat" (the chat template,
    multi-turn), "alpaca" or "text" (each line on its own); `generate_kw` goes to `generate`
    (max_new_tokens, sampling)."""
    # input() shows "> " but, reading a pipe, no typed newline: chat writes it
    piped = read is None and not getattr(sys.stdin, "isatty", lambda: False)()
    read, out = read or input, out or sys.stdout
    turns = prompt_format == "chat"
    if turns and not getattr(tokenizer, "chat_template", None):
        raise LeantuneError("the tokenizer has no chat template, which `leantune chat` needs; "
                            "use an instruct/chat model, or --prompt-format text (or alpaca) "
                            "to ask each line on its own")
    if not turns:
        typed_prompt("", prompt_format, system)  # --system needs turns: one line, before a word
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    out.write(f"chat: {HELP}\n")
    if not turns:
        out.write(f"(each line is asked on its own, in {DESCRIBE[prompt_format]}, as the model "
                  "was trained)\n")
    while True:
        try:
            line = read("> ")
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n")
            raise
        if piped:
            out.write("\n")
        command = line.strip()
        if not command:
            continue
        if command == "/exit":
            return
        if command == "/reset":
            messages = list(start)
            out.write("(a new conversation)\n")
            continue
        messages.append({"role": "user", "content": line})
        prompt = messages if turns else typed_prompt(line, prompt_format)
        most = generate_kw.get("max_new_tokens", MAX_NEW_TOKENS)
        try:
            room = _room(model, tokenizer, prompt, most)
            reply = generate(model, tokenizer, [prompt], streamer=TextStreamer(tokenizer, out),
                             **{**generate_kw, "max_new_tokens": room})[0]
        except KeyboardInterrupt:
            out.write("\n")
            raise
        except PromptTooLong as e:
            messages.pop()
            out.write(_too_long(e, fresh=not turns or messages == start, system=bool(system)))
            continue
        messages.append({"role": "assistant", "content": reply.text})
        if not turns:
            messages = list(start)
        if reply.stopped == "length":  # (short of max_new_tokens: at the model's context)
            out.write("(the reply reached --max-new-tokens and was cut)\n"
                      if len(reply.token_ids) >= most else
                      "(the reply reached the end of the model's context and was cut; /reset "
                      "starts a new conversation)\n")


def _room(model, tokenizer, prompt, most: int) -> int:
    """The most new tokens of the reply to `prompt`: `most` (--max-new-tokens), or fewer where
    the model's context leaves fewer (PromptTooLong where it leaves none). generate, asked for
    no more than that, says no note of its own: a reply cut at the context is said once, after
    it, with what to do."""
    if not (isinstance(most, int) and most >= 1):
        return most  # (generate refuses it in one line)
    ids = prompt_ids(tokenizer, prompt, "prompt 1")
    return fit_to_context([ids], [None], most, model.config, log=lambda _: None)[0]


def _too_long(e: PromptTooLong, fresh: bool, system: bool) -> str:
    """The line for a message the model's context has no room to answer (left out: the chat
    goes on). `fresh`: nothing earlier in the conversation to drop."""
    if fresh:
        return (f"(your message makes a prompt of {e.tokens:,} tokens{e.how}, and the model's "
                f"context holds {e.context:,} for the prompt and the reply together; it was "
                f"left out: shorten it{' (or --system)' if system else ''})\n")
    return (f"(with your message the conversation is {e.tokens:,} tokens, and the model's "
            f"context holds {e.context:,} for the conversation and the reply together; it was "
            "left out: /reset starts a new conversation, or send a shorter message)\n")
