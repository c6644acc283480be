"""`verispec chat`: the conversation in process, then the REPL in a pseudo-terminal, on a tiny model."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from drafters_common import build_no_template_model, build_tok_model

import verispec
from verispec import Engine, SamplingParams, SpecConfig, VerispecError
from verispec.chat import Chat
from verispec.console import ACCEPTED

MAX_LEN = 128
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")
# The draft model is the target itself: every draft is accepted, so each step is k drafts and one bonus token.
SELF_DRAFT = SpecConfig(method="draft", k=3, k_policy="fixed")


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tok_model(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_no_template_model(tmp_path_factory.mktemp("raw_model"))


@pytest.fixture(scope="module")
def engine(tok_model: Path) -> Engine:
    return Engine.from_pretrained(str(tok_model), draft=str(tok_model), dtype="float32", max_len=MAX_LEN,
                                  progress=False)


# -- chat, in process --------------------------------------------------------------------------

def _chat(engine: Engine, max_tokens: int = 10, **kwargs) -> tuple[Chat, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    chat = Chat(engine, SamplingParams(max_tokens=max_tokens, ignore_eos=True), SELF_DRAFT, out=out, err=err,
                colour=False, **kwargs)
    return chat, out, err


def _reader(lines: list[str]) -> Callable[[str], str]:
    """An ``input`` replacement that types ``lines``, then Ctrl-D."""
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def test_chat_keeps_the_conversation(engine):
    chat, out, _ = _chat(engine, system="answer in one word")
    first = chat.ask("hello world")
    asked = [*chat.messages, {"role": "user", "content": "what about the dog"}]
    second = chat.ask("what about the dog")
    assert second.prompt_token_ids == engine.encode(asked)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [chat.messages[2]["content"], chat.messages[4]["content"]] == [first.text, second.text]
    assert out.getvalue().count("mean accepted length") == 2 and first.text in out.getvalue()
    assert chat.total.requests == 2 and chat.total.generated_tokens == 20
    chat.handle("/reset")
    assert chat.messages == [{"role": "system", "content": "answer in one word"}]


def test_chat_drops_the_oldest_exchanges_to_fit_the_context(engine):
    chat, out, err = _chat(engine, max_tokens=40, system="be brief")
    for i in range(6):
        assert chat.ask(f"question {i} about the cat and the dog") is not None
        assert chat.messages[0] == {"role": "system", "content": "be brief"}
        assert len(engine.encode(chat.messages[:-1])) + 40 <= MAX_LEN  # what was asked left room for the answer
    assert "dropped the oldest" in out.getvalue() and not err.getvalue()
    assert chat.messages[1]["content"] != "question 0 about the cat and the dog"


def test_chat_refuses_a_question_longer_than_the_context(engine):
    chat, _, err = _chat(engine)
    assert chat.ask("the cat " * 100) is None
    assert "context holds" in err.getvalue() and chat.messages == []


def test_cancelled_answer_stays_as_shown(engine):
    chat, out, _ = _chat(engine, max_tokens=40)

    class CancelOnWrite(io.StringIO):
        def write(self, s: str) -> int:
            chat.cancel()
            return super().write(s)

    chat.out = CancelOnWrite()
    result = chat.ask("hello world")
    assert result.finish_reason == "cancelled" and len(result.token_ids) == 4  # one step
    shown = chat.out.getvalue().split("\n")[0]
    assert chat.messages[-1] == {"role": "assistant", "content": shown} and shown == result.text


def test_interrupted_answer_drops_the_exchange(engine):
    chat, _, _ = _chat(engine, max_tokens=40)
    chat.ask("hello world")
    before = list(chat.messages)

    class InterruptOnce(io.StringIO):
        def write(self, s: str) -> int:
            if not self.getvalue():
                super().write(s)
                raise KeyboardInterrupt
            return super().write(s)

    chat.out = InterruptOnce()
    assert chat.ask("what about the dog") is None
    assert chat.messages == before and "dropped" in chat.out.getvalue()


def test_ctrl_c_before_generating_leaves_no_question_unanswered(engine, monkeypatch):
    chat, _, _ = _chat(engine, system="be brief")

    def interrupted() -> list[int]:
        raise KeyboardInterrupt

    monkeypatch.setattr(chat, "_prompt_ids", interrupted)
    assert chat.run(_reader(["hello world"])) == 0
    assert chat.messages == [{"role": "system", "content": "be brief"}]


def test_ctrl_c_while_generating_cancels_then_interrupts(engine):
    chat, _, _ = _chat(engine)
    handler = signal.getsignal(signal.SIGINT)
    with chat._sigint():
        os.kill(os.getpid(), signal.SIGINT)
        assert chat._cancelled
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is handler


def test_chat_commands_and_refusals(engine, no_template_model):
    chat, out, err = _chat(engine)
    assert chat.handle("/help") and "/stats" in out.getvalue()
    assert chat.handle("/nope") and "unknown command /nope" in err.getvalue()
    assert chat.handle("   ") and chat.total.requests == 0
    assert not chat.handle("/exit")
    assert chat.run(_reader(["hello world", "/stats"])) == 0
    assert "answers: 1" in out.getvalue() and "acceptance: 100.0%" in out.getvalue()
    raw = Engine.from_pretrained(str(no_template_model), dtype="float32", max_len=MAX_LEN, progress=False)
    with pytest.raises(VerispecError, match="no chat template"):
        Chat(raw, SamplingParams(), SpecConfig())
    with pytest.raises(VerispecError, match="max-tokens"):
        Chat(engine, SamplingParams(max_tokens=MAX_LEN), SpecConfig())


# -- chat in a terminal -------------------------------------------------------------------------

def test_chat_in_a_terminal(tok_model, engine):
    pexpect = pytest.importorskip("pexpect")
    root = str(Path(verispec.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", TERM="xterm")
    env.pop("NO_COLOR", None)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cmd = ["-m", "verispec.cli", "chat", "--model", str(tok_model), "--draft", str(tok_model), "--dtype", "float32",
           "--max-len", str(MAX_LEN), "--max-tokens", "12", "--ignore-eos", "-k", "3", "--k-policy", "fixed",
           "--method", "draft", "--confidence", "0", "--draft-vocab", "0", "--draft-window", "0"]
    # A shell without job control starts background commands with SIGINT ignored, and a child inherits
    # that; a terminal user's chat gets Ctrl-C, so the child gets the default disposition back.
    child = pexpect.spawn(sys.executable, cmd, env=env, cwd=root, encoding="utf-8", timeout=180,
                          dimensions=(40, 400), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child.expect_exact(">>> ")
        child.sendintr()  # Ctrl-C at the prompt: a fresh prompt
        child.expect_exact(">>> ")
        messages = [{"role": "user", "content": "hello world"}]
        expected = engine.generate(messages, params, SELF_DRAFT)[0].text
        child.sendline("hello world")
        child.expect(r"\[12 tokens, [0-9.]+ tokens/s, acceptance 100%, mean accepted length 4\.00")
        answer = child.before  # the echoed question, then the answer, all before the figures
        assert ACCEPTED in answer  # accepted drafts in colour on a terminal
        assert ANSI.sub("", answer).replace("\r", "").strip().endswith(expected)
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"answers: 1\s+tokens: 12 in")
        child.expect_exact(">>> ")

        messages += [{"role": "assistant", "content": expected}, {"role": "user", "content": "what about the dog"}]
        expected = engine.generate(messages, params, SELF_DRAFT)[0].text
        child.sendline("what about the dog")
        child.expect(r"\[12 tokens, ")
        assert ANSI.sub("", child.before).replace("\r", "").strip().endswith(expected)
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"answers: 2\s+tokens: 24 in")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_edit_attaches_a_file_that_is_quoted_and_predicted(engine, tmp_path):
    chat, out, err = _chat(engine, max_tokens=12)
    plain = chat.ask("hello")
    code = tmp_path / "code.txt"
    code.write_text(plain.text + "\n", encoding="utf-8")
    chat.reset()
    assert chat.handle(f"/edit {code}") and "attached" in out.getvalue()
    predicted = chat.ask("hello")
    assert chat.messages[-2]["content"] == f"hello\n\n```\n{plain.text}\n```"  # the file is quoted
    assert predicted.metrics.accepted_prediction_tokens > 0 and "prediction " in out.getvalue()
    assert chat.attached is None  # one message only
    chat.handle("/edit")
    chat.handle(f"/edit {tmp_path / 'missing.txt'}")
    assert "/edit needs a file" in err.getvalue() and "/edit: cannot read" in err.getvalue()
