"""How a command ends on a user error: one line, exit status 2; a bug keeps its traceback."""

from __future__ import annotations

import errno
from collections.abc import Callable

import pytest

from dflash_train.errors import run_with_one_line_errors


def fails_with(error: BaseException) -> Callable[[], int]:
    def call() -> int:
        raise error

    return call


def test_a_multi_line_message_is_printed_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_with_one_line_errors("dflash-train x", fails_with(ValueError("first part\n  second part"))) == 2
    assert capsys.readouterr().err == "dflash-train x: error: first part second part\n"


def test_a_path_that_cannot_be_used_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    error = PermissionError(errno.EACCES, "Permission denied", "/root/forbidden/out")
    assert run_with_one_line_errors("dflash-train x", fails_with(error)) == 2
    assert capsys.readouterr().err == ("dflash-train x: error: Permission denied: /root/forbidden/out; check the path "
                                       "and its permissions\n")


def test_a_bug_keeps_its_traceback() -> None:
    with pytest.raises(KeyError):
        run_with_one_line_errors("dflash-train x", fails_with(KeyError("internal")))
    with pytest.raises(OSError):  # an OS error without a path is not something the user named
        run_with_one_line_errors("dflash-train x", fails_with(OSError("no path here")))
