"""Self-prompting (`dflash_train.regeneration.self_prompts`, `dflash-train self-prompt`): the opening of a user turn is
what the template writes before a message; generated turns are kept or dropped by the stated rules; rows draw
from distinct seeds in chunks queued ahead; the command writes a deterministic file and never replaces data it
did not write."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.data.chat import ChatTokenizer
from dflash_train.prompts.decontaminate import build_index
from dflash_train.quality import DataReport
from dflash_train.regeneration.self_prompts import (
    SOURCE,
    Settings,
    drop_reason,
    prompt_key,
    self_prompts,
    source_label,
    user_turn_prefix,
)
from dflash_train.runtime.sampling import request_seed
from tests.helpers.tiny_models import make_tiny_target, make_tiny_tokenizer

# ChatML with a default system turn when the conversation has none (as SmolLM2's template does).
DEFAULT_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_the_prefix_is_what_the_template_writes_before_a_user_message() -> None:
    chat = ChatTokenizer(make_tiny_tokenizer(chat_template=DEFAULT_SYSTEM_TEMPLATE), None, "tiny")
    prefix = user_turn_prefix(chat)
    assert prefix == "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"
    for content in ("hello", "what is the capital of france ?"):
        assert chat.render([{"role": "user", "content": content}]) == f"{prefix}{content}<|im_end|>\n"


def test_a_template_that_rewrites_the_message_is_refused() -> None:
    upper = DEFAULT_SYSTEM_TEMPLATE.replace("message['content']", "(message['content'] | upper)")
    with pytest.raises(ValueError, match="does not render a user message's content as given"):
        user_turn_prefix(ChatTokenizer(make_tiny_tokenizer(chat_template=upper), None, "tiny"))


@dataclass
class Out:
    token_ids: list[int]
    finish_reason: str


def test_drop_reasons() -> None:
    specials = frozenset({1, 2})
    assert drop_reason(Out([5, 6, 7], "length"), "a b c", specials) == "unfinished_turn"
    assert drop_reason(Out([5, 1, 7], "stop"), "a b c", specials) == "special_token"
    assert drop_reason(Out([5, 6], "stop"), "a b", specials) == "too_few_words"
    assert drop_reason(Out([5], "stop"), " ".join(["w"] * 401), specials) == "too_many_words"
    assert drop_reason(Out([5, 6, 7], "stop"), "a b c", specials) is None
    assert prompt_key("  Plan a\n TRIP ") == prompt_key("plan a trip")


class ScriptedTarget:
    """A Submitter whose row with seed s writes TEXTS[s's row id]; it records what was queued and when."""

    def __init__(self, texts: Callable[[int], str], seed: int) -> None:
        self.by_seed = {request_seed(seed, row): row for row in range(10_000)}
        self.texts, self.events = texts, []  # ("submit", n) / ("wait", n)

    def submit(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> Callable[[], list[Out]]:
        assert all(list(p) == [9, 9] for p in prompts)
        self.events.append(("submit", len(seeds)))

        def wait() -> list[Out]:
            self.events.append(("wait", len(seeds)))
            return [Out([100 + self.by_seed[s]], "stop") for s in seeds]
        return wait


def run_scripted(texts: Callable[[int], str], count: int, chunk: int, evals: object = None,
                 **settings: str) -> tuple[list[dict], DataReport, ScriptedTarget]:
    target = ScriptedTarget(texts, seed=7)
    report = DataReport("test")
    rows = self_prompts(target, lambda ids: texts(ids[0] - 100), [9, 9], frozenset(),
                        Settings(count, 7, chunk, **settings), evals, report)  # type: ignore[arg-type]
    return rows, report, target


def test_an_opening_starts_every_prompt_and_the_rows_carry_their_label() -> None:
    """The target's tokens carry their own spaces: the opening and what it wrote are joined as they are; the
    word limits apply to what it wrote (an opening alone is no prompt)."""
    texts = {0: " Tom has 3 apples and buys 2 more.", 1: " hi", 2: "\n\nA train leaves at noon at 60 mph."}
    rows, report, _ = run_scripted(lambda i: texts.get(i, f" problem {i} is here"), count=3, chunk=3,
                                   opening="Here is a math word problem:", source=source_label("math"))
    assert [row["messages"][0]["content"] for row in rows] == [
        "Here is a math word problem: Tom has 3 apples and buys 2 more.",
        "Here is a math word problem:\n\nA train leaves at noon at 60 mph.", "Here is a math word problem: problem 3 is here"]
    assert {row["source"] for row in rows} == {"self-prompts:math"} and report.dropped["too_few_words"] == 1
    assert source_label(None) == SOURCE
    with pytest.raises(ValueError, match="names a data source"):
        source_label("math problems")


def test_a_request_follows_every_kept_prompt_and_takes_no_part_in_keeping_it() -> None:
    """The request comes after a blank line; prompts are told apart, and counted, without it (two that differ
    only in case are one prompt, a one-word turn is still too short)."""
    texts = {0: " Tom has 3 apples.", 1: " hi", 2: " TOM has 3  apples.", 3: " A train leaves at noon."}
    rows, report, _ = run_scripted(lambda i: texts.get(i, f" problem {i} is here"), count=2, chunk=4,
                                   opening="A problem:", request="Solve it step by step.")
    assert [row["messages"][0]["content"] for row in rows] == [
        "A problem: Tom has 3 apples.\n\nSolve it step by step.",
        "A problem: A train leaves at noon.\n\nSolve it step by step."]
    assert dict(report.dropped) == {"too_few_words": 1, "duplicate_prompt": 1}


def test_rows_are_kept_in_order_from_distinct_seeds_with_the_next_chunk_queued_ahead() -> None:
    texts = {0: "plan a trip for me", 1: "hi", 2: "PLAN a  trip for me", 3: "write a poem about rain",
             4: "explain how tides work", 5: "name three rivers please"}
    rows, report, target = run_scripted(lambda i: texts.get(i, f"question number {i} here"), count=4, chunk=3)
    assert [row["messages"][0]["content"] for row in rows] == [
        "plan a trip for me", "write a poem about rain", "explain how tides work", "name three rivers please"]
    assert [row["source_index"] for row in rows] == [0, 3, 4, 5] and {row["source"] for row in rows} == {SOURCE}
    assert (report.read, report.kept, dict(report.dropped)) == (6, 4, {"too_few_words": 1, "duplicate_prompt": 1})
    # Chunk k + 1 is queued before chunk k is waited for: the runtime refills freed rows from it.
    assert target.events[:4] == [("submit", 3), ("submit", 3), ("wait", 3), ("submit", 3)]


def test_ranks_draw_one_runs_rows_between_them_each_row_once() -> None:
    """Rank r of 3 draws the rows r, r + 3, ...: the three ranks' shares (4, 3, 3 of 10) are the ten rows one
    process keeps, by the same seeds, none twice. Row 4, too short, is rank 1's second draw: rank 1 draws row 10
    in its place, as the single process does after row 9."""
    texts = {4: "hi"}  # row 4 is rank 1's second draw: too short

    def kept(rank: int, world: int, count: int) -> list[tuple[int, str]]:
        rows, _, _ = run_scripted(lambda i: texts.get(i, f"question number {i} here"), count=count, chunk=2,
                                  rank=rank, world=world)  # type: ignore[arg-type]
        return [(row["source_index"], row["messages"][0]["content"]) for row in rows]

    alone = kept(0, 1, 10)
    together = sorted(kept(0, 3, 4) + kept(1, 3, 3) + kept(2, 3, 3))
    assert [i for i, _ in alone] == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10]
    assert together == alone
    assert [i for i, _ in kept(0, 3, 4)] == [0, 3, 6, 9] and [i for i, _ in kept(1, 3, 3)] == [1, 7, 10]


def test_a_target_that_repeats_itself_ends_the_run_with_what_it_kept() -> None:
    rows, report, _ = run_scripted(lambda i: f"the same prompt {i % 3} again", count=50, chunk=200)
    assert len(rows) == 3 and report.read == 200  # chunks of 2 × count; the second added nothing new: stop
    rows, report, _ = run_scripted(lambda i: "tiny", count=5, chunk=40)
    assert rows == [] and report.read == 10


def test_prompts_that_overlap_an_eval_set_are_left_out() -> None:
    eval_text = "compose an engaging travel blog post about a recent trip to hawaii highlighting cultural experiences"
    evals = build_index({"mt-bench": [eval_text]})
    texts = {0: f"please {eval_text} and must see attractions", 1: "write a haiku about the sea"}
    rows, report, _ = run_scripted(lambda i: texts.get(i, f"question {i} for you"), count=2, chunk=4, evals=evals)
    assert [row["source_index"] for row in rows] == [1, 2]
    assert report.dropped["overlaps_eval_set"] == 1


def save_talkative_target(path: Path) -> Path:
    """A tiny random target whose turns end often: a third of its words end a turn (its generation config's
    end-of-sequence ids), so that sampled turns of a few words finish within the token cap."""
    target = make_tiny_target("qwen3", num_layers=2, seed=0)
    target.model.generation_config.eos_token_id = list(range(40, 140))
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def self_prompt(target: Path, out: Path, *extra: str) -> int:
    return main(["self-prompt", "--target", str(target), "--num-prompts", "4", "--max-new-tokens", "12",
                 "--device", "cpu", "--dtype", "fp32", "--kernels", "torch", "--no-compile", "--out", str(out), *extra])


def test_the_command_writes_the_same_file_for_the_same_settings_and_keeps_other_data(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = save_talkative_target(tmp_path / "target")
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert self_prompt(target, first) == 0 and self_prompt(target, second) == 0
    assert first.read_bytes() == second.read_bytes()
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    assert 0 < len(rows) <= 4 and {row["source"] for row in rows} == {SOURCE}
    assert len({prompt_key(row["messages"][0]["content"]) for row in rows}) == len(rows)
    assert "prompts kept of" in capsys.readouterr().out
    assert self_prompt(target, first) == 2  # exists: not replaced without --overwrite
    assert "pass --overwrite" in capsys.readouterr().err
    assert self_prompt(target, first, "--overwrite", "--seed", "1") == 0
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text('{"messages": [{"role": "user", "content": "mine"}]}\n')
    assert self_prompt(target, theirs, "--overwrite") == 2
    assert "holds other data" in capsys.readouterr().err
    assert theirs.read_text() == '{"messages": [{"role": "user", "content": "mine"}]}\n'
    assert self_prompt(target, tmp_path / "c.jsonl", "--temperature", "0") == 2


def test_a_rank_writes_its_share_into_a_file_of_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 of 2 keeps 2 of the 4 prompts, from the odd rows, in out.rank1-of2.jsonl; --out itself is not
    written. A count that leaves a rank nothing, and a rank outside the world, are one-line errors."""
    target = save_talkative_target(tmp_path / "target")
    out = tmp_path / "self.jsonl"
    assert self_prompt(target, out, "--rank", "1", "--world-size", "2") == 0
    rows = [json.loads(line) for line in (tmp_path / "self.rank1-of2.jsonl").read_text().splitlines()]
    assert 0 < len(rows) <= 2 and all(row["source_index"] % 2 == 1 for row in rows)
    assert not out.exists()
    capsys.readouterr()
    assert main(["self-prompt", "--target", str(target), "--num-prompts", "1", "--rank", "1", "--world-size", "2",
                 "--device", "cpu", "--out", str(out)]) == 2
    assert "leaves rank 1 of 2 no prompt to write" in capsys.readouterr().err
    assert self_prompt(target, out, "--rank", "2", "--world-size", "2") == 2
    assert "outside world size 2" in capsys.readouterr().err


def test_the_command_continues_its_opening_and_labels_the_rows(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """--opening is part of what the target continues (the prompt ids end with it) and of every kept prompt;
    --label names the rows' source, and such a file is the command's own to --overwrite."""
    from dflash_train.commands import self_prompt as command

    target = save_talkative_target(tmp_path / "target")
    queued: list[list[int]] = []

    class Recording(command.Generator):
        def submit(self, prompts, seeds):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
            queued.extend(list(p) for p in prompts[:1])
            return super().submit(prompts, seeds)

    monkeypatch.setattr(command, "Generator", Recording)
    out = tmp_path / "math.jsonl"
    opening = "Here is a word problem:"
    assert self_prompt(target, out, "--opening", opening, "--label", "math") == 0
    chat = ChatTokenizer(make_tiny_target("qwen3", num_layers=2, seed=0).tokenizer, None, "tiny")
    prefix = chat.encode_texts([user_turn_prefix(chat)])[0]
    assert queued[0] == chat.encode_texts([user_turn_prefix(chat) + opening])[0]
    assert queued[0][: len(prefix)] == prefix and len(queued[0]) > len(prefix)  # the opening's tokens follow
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(row["messages"][0]["content"].startswith(opening) for row in rows)
    assert {row["source"] for row in rows} == {"self-prompts:math"}
    assert self_prompt(target, out, "--opening", opening, "--label", "math", "--overwrite", "--seed", "1",
                       "--request", "Show your steps. ") == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(row["messages"][0]["content"].endswith("\n\nShow your steps.") for row in rows)
    assert self_prompt(target, tmp_path / "x.jsonl", "--label", "bad label") == 2
