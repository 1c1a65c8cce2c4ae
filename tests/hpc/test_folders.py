"""The agent runs as root in folders its users own: it never follows a link they leave there."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from agents.hpc import read_owned
from tests.hpc.conftest import PlaneStandIn, make_backend

pytestmark = pytest.mark.usefixtures("accounts")


def as_account(path: Path, account: str) -> None:
    user = pwd.getpwnam(account)
    os.lchown(path, user.pw_uid, user.pw_gid)


def test_only_plain_files_of_the_jobs_account_are_read(jobs_dir: Path) -> None:
    folder = jobs_dir / "task"
    folder.mkdir()
    secret = jobs_dir / "roots-own"
    secret.write_text("root's secret\n")
    (folder / "output.log").symlink_to(secret)
    as_account(folder / "output.log", "kqalice")
    assert read_owned(folder / "output.log", "kqalice") is None  # a link: not followed
    (folder / "exit-code").write_text("0")
    assert read_owned(folder / "exit-code", "kqalice") is None  # root's file, not the account's
    as_account(folder / "exit-code", "kqalice")
    assert read_owned(folder / "exit-code", "kqalice") == "0"
    assert read_owned(folder / "exit-code", "kqbob") is None  # another account's


def test_a_new_run_gets_a_fresh_folder_whatever_the_last_one_left(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    target = jobs_dir / "precious"
    target.write_text("keep me\n")
    folder = jobs_dir / "task"
    folder.mkdir()
    (folder / "token").symlink_to(target)  # left by the account in its folder of an earlier run
    (folder / "job.sh").symlink_to(target)
    as_account(folder, "kqalice")
    backend = make_backend("slurm", jobs_dir, plane, tmp_path)
    script = backend._prepare(folder, "kqalice", "kqt_x_y", "#!/bin/bash\ntrue\n")
    assert target.read_text() == "keep me\n"
    assert target.stat().st_uid == 0
    assert (folder / "token").read_text() == "kqt_x_y"
    assert not (folder / "token").is_symlink()
    assert not script.is_symlink()
    owner = pwd.getpwnam("kqalice").pw_uid
    assert {(folder / name).stat().st_uid for name in ("token", "job.sh")} == {owner}
    assert folder.stat().st_uid == owner
    assert oct((folder / "token").stat().st_mode & 0o777) == "0o600"
