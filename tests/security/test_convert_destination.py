"""``convert``'s destination: the final rename replaces nothing it did not check.

Before: two converts to one destination both exited 0, the second silently replacing the
first's output; ``--force`` onto a symlink replaced the link's target in another folder; a
read-only or full destination was a raw ``OSError`` traceback.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptshim.cli import main
from ckptshim.conversion import atomic
from ckptshim.conversion.atomic import DestinationExistsError, atomic_destination
from ckptshim.errors import ShimError
from support.fixtures import FIXTURES

SAFETENSORS = FIXTURES / "hf_gptneox_tf4.30.2/safetensors/model.safetensors"

_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ckptshim.conversion.atomic import atomic_destination
    destination, me, other = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    try:
        with atomic_destination(destination) as tmp:
            (tmp / destination.name).write_bytes(me.name.encode() * 1000)
            me.touch()  # written, not yet renamed: wait until the other writer is here too
            deadline = time.monotonic() + 30
            while not other.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
    except Exception as error:
        print(type(error).__name__, error)
        sys.exit(1)
    """)


def test_two_converts_to_one_destination_one_wins(tmp_path):
    """Both writers pass the 'does DST exist' check before either renames; exactly one rename
    succeeds and the other says another process created DST."""
    destination = tmp_path / "out.safetensors"
    ready = [tmp_path / "writer-a", tmp_path / "writer-b"]
    processes = [subprocess.Popen([sys.executable, "-c", _WRITER, str(destination), str(me), str(other)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for me, other in (ready, ready[::-1])]
    results = [(p.wait(timeout=60), p.stdout.read() + p.stderr.read()) for p in processes]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = next(text for code, text in results if code == 1)
    assert "DestinationExistsError" in loser and "created by another process" in loser
    winner = next(me for me, (code, _) in zip(ready, results) if code == 0)
    assert destination.read_bytes() == winner.name.encode() * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out.safetensors", *(r.name for r in ready)])


def test_force_replaces_a_link_never_its_target(tmp_path):
    """``atomic_destination(force=True)`` on a symlink: the link is replaced by the new output
    and the file it pointed at, in another folder, is untouched."""
    target = tmp_path / "other" / "keep.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"keep me")
    link = tmp_path / "out.safetensors"
    link.symlink_to(target)
    with atomic_destination(link, force=True) as tmp:
        (tmp / link.name).write_bytes(b"new")
    assert not link.is_symlink() and link.read_bytes() == b"new"
    assert target.read_bytes() == b"keep me"


def test_convert_force_onto_a_symlink_replaces_the_link(tmp_path):
    target = tmp_path / "other" / "keep.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"keep me")
    link = tmp_path / "out.safetensors"
    link.symlink_to(target)
    assert main(["convert", str(SAFETENSORS), str(link), "--to", "safetensors", "--force"]) == 0
    assert target.read_bytes() == b"keep me" and not link.is_symlink()


def test_force_puts_back_what_it_did_not_check(tmp_path):
    """DST replaced by someone else while the convert ran: the exchange brings out a file that
    is not the one checked, so it is put back and the convert fails."""
    destination = tmp_path / "out.safetensors"
    destination.write_bytes(b"checked")
    with pytest.raises(DestinationExistsError, match="replaced by another process"):
        with atomic_destination(destination, force=True) as tmp:
            (tmp / destination.name).write_bytes(b"ours")
            destination.unlink()
            destination.write_bytes(b"someone else's")
    assert destination.read_bytes() == b"someone else's"
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


@pytest.mark.parametrize("force", [False, True])
def test_lock_file_where_renameat2_is_missing(tmp_path, monkeypatch, force):
    monkeypatch.setattr(atomic, "_renameat2", lambda *args: False)
    destination = tmp_path / "out.safetensors"
    if force:
        destination.write_bytes(b"old")
    with atomic_destination(destination, force=force) as tmp:
        (tmp / destination.name).write_bytes(b"new")
    assert destination.read_bytes() == b"new"
    with pytest.raises(DestinationExistsError, match="created by another process"):
        with atomic_destination(tmp_path / "second.safetensors") as tmp:
            (tmp / "second.safetensors").write_bytes(b"ours")
            (tmp_path / "second.safetensors").write_bytes(b"theirs")
    assert (tmp_path / "second.safetensors").read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "second.safetensors"]


def test_read_only_destination_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """Creating the temporary folder fails as on a read-only file system (simulated: the suite
    may run as root, for whom permission bits do not apply)."""
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if atomic.TEMP_TAG in self.name:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["convert", str(SAFETENSORS), str(tmp_path / "out.safetensors"), "--to", "safetensors"]) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error and "must be a writable folder" in error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_really_read_only_destination(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert main(["convert", str(SAFETENSORS), str(folder / "out.safetensors"), "--to", "safetensors"]) == 1
        assert "must be a writable folder" in capsys.readouterr().err
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("code, said", [(errno.ENOSPC, "the file system is full"),
                                        (errno.EDQUOT, "the disk quota is used up")])
def test_full_destination_is_a_clear_error_and_leaves_nothing(tmp_path, code, said):
    destination = tmp_path / "out"
    with pytest.raises(ShimError, match=said):  # atomic.DestinationError
        with atomic_destination(destination) as tmp:
            (tmp / "part").write_bytes(b"x" * 100)
            raise OSError(code, os.strerror(code))
    assert list(tmp_path.iterdir()) == []


def test_full_destination_through_convert(tmp_path, monkeypatch, capsys):
    from ckptshim.conversion import safetensors_writer

    def full(arrays, folder, destination_name, progress):
        with folder.create("model.safetensors") as out:
            out.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors_writer, "write", full)
    assert main(["convert", str(SAFETENSORS), str(tmp_path / "out"), "--to", "safetensors"]) == 1
    assert "the file system is full" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
