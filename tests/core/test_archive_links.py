"""Hub model archives (``from_pretrained("model.tar.gz", ...)``) that hold links, special files or far more than a
model: each is refused with one line before anything is written, and nothing is left on disk. The archives hold
the de-en release's Transformer under ``model/``, so one that is not refused loads."""

import gzip
import io
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

import fairseq_ext  # noqa: F401  (installs the hub's archive loader)
from fairseq_ext.checkpoints import archives
from fairseq_ext.common.errors import FairseqExtError
from tests.helpers import ROOT, assert_one_line_error

DE_EN = os.path.join(ROOT, "releases", "bible-de-en")
if not os.path.isfile(os.path.join(DE_EN, "transformer.pt")):
    pytest.skip("no release in releases/bible-de-en", allow_module_level=True)
MODEL = (("model.pt", "transformer.pt"), ("dict.de.txt", "dict.txt"), ("dict.en.txt", "dict.txt"),
         ("sentencepiece.bpe.model", "spm.model"))
REFUSED = r"refusing to unpack model archive .*; nothing was extracted"


def _member(name, data=b"ran", kind=tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, io.BytesIO(data) if kind == tarfile.REGTYPE else None


def _archive(path, extra=(), raw=b""):
    """The release as a hub archive (``model/``), then the members ``extra`` and the raw tar blocks ``raw``."""
    with tarfile.open(path, "w:gz", format=tarfile.GNU_FORMAT) as t:
        for name, src in MODEL:
            t.add(os.path.join(DE_EN, src), arcname=f"model/{name}")
        for member in extra:
            t.addfile(*member)
        t.fileobj.write(raw)
        t.offset += len(raw)
    return str(path)


def _from_pretrained(archive):
    from fairseq.models.transformer import TransformerModel

    return TransformerModel.from_pretrained(archive, checkpoint_file="model.pt", bpe="sentencepiece",
                                            source_lang="de", target_lang="en")


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """The temporary directory archives are unpacked under (tmp_path/tmp)."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp"


def _refused(archive, tmp, match=REFUSED):
    with pytest.raises(FairseqExtError, match=match) as e:
        _from_pretrained(archive)
    assert "\n" not in str(e.value)
    assert os.path.isfile(archive)
    assert os.listdir(tmp) == []  # no directory left behind, not even an empty one
    return str(e.value)


def _link_chain(victim):
    """The CVE-2025-4517 chain: 16 nested 247-character directories, each reached through a one-letter link; a
    254-character link at the bottom to ``../`` x16 (the top again); and ``model/escape`` -> that link, then ``..``
    x17 and ``victim``. Resolved lexically (what tarfile's ``data`` filter does once the real path is longer than
    PATH_MAX) ``escape`` stays inside the directory; the kernel resolves it to ``/`` + ``victim``."""
    steps, comp = "abcdefghijklmnop", "d" * 247
    members, path = [], "model"
    for step in steps:
        members += [_member(f"{path}/{comp}", kind=tarfile.DIRTYPE),
                    _member(f"{path}/{step}", kind=tarfile.SYMTYPE, link=comp)]
        path = f"{path}/{comp}"
    long_link = "/".join(steps) + "/" + "l" * 254
    members.append(_member(f"model/{long_link}", kind=tarfile.SYMTYPE, link="../" * len(steps)))
    members.append(_member("model/escape", kind=tarfile.SYMTYPE,
                           link=long_link + "/.." * 17 + "/" + str(victim).lstrip("/")))
    members.append(_member("model/escape/marker", data=b"written through the link chain"))
    return members


def test_a_link_chain_past_path_max_is_refused_and_writes_nothing_outside(tmp_path, tmp):
    victim = tmp_path / "victim" / "dir"
    victim.mkdir(parents=True)
    (victim / "kept").write_text("kept")
    # the chain reaches "/" from the extraction directory (tmp_path/tmp/<new>/model) with 17 ".."
    assert len((tmp / "x" / "model").parts) <= 17
    archive = _archive(tmp_path / "evil.tar.gz", _link_chain(victim))
    message = _refused(archive, tmp)
    assert "is a link" in message, message
    assert sorted(os.listdir(victim)) == ["kept"] and (victim / "kept").read_text() == "kept"
    assert sorted(os.listdir(tmp_path)) == ["evil.tar.gz", "tmp", "victim"]


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_inside_the_archive_is_refused_too(tmp_path, tmp, kind):
    """A link whose target stays inside (which tarfile's ``data`` filter allows): a model archive needs none."""
    link = _member("model/copy.pt", kind=tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE,
                   link="model.pt" if kind == "symlink" else "model/model.pt")
    archive = _archive(tmp_path / "links.tar.gz", [link])
    message = _refused(archive, tmp)
    assert "'model/copy.pt' is a link" in message, message


def _model_tar():
    """The uncompressed tar blocks of the release under ``model/``, without the end-of-archive blocks."""
    buf = io.BytesIO()
    t = tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT)
    for name, src in MODEL:
        t.add(os.path.join(DE_EN, src), arcname=f"model/{name}")
    return buf.getvalue()


def _bomb(path, size, chunk=16 << 20):
    """A .tar.gz of ~size/1000 bytes that unpacks to ``size`` bytes: the model, then ``model/zeros.bin`` of
    ``size`` zeros, stored as one gzip member of ``chunk`` zeros repeated (gzip readers join gzip members)."""
    assert size % chunk == 0
    info = tarfile.TarInfo("model/zeros.bin")
    info.size = size
    zeros = gzip.compress(bytes(chunk), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(_model_tar() + info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")))
        for _ in range(size // chunk):
            f.write(zeros)
        f.write(gzip.compress(bytes(2 * tarfile.BLOCKSIZE)))
    return str(path)


def test_a_tar_bomb_is_one_line_and_leaves_nothing(tmp_path):
    """A .tar.gz of ~17 MB whose member unpacks to twice the default cap (16 GiB of zeros), through the hub in a
    fresh process whose files may not grow past 256 MB (so the disk stays as it was even if the cap fails)."""
    size = 2 * archives.DEFAULT_MAX_BYTES
    archive = _bomb(tmp_path / "bomb.tar.gz", size)
    assert os.path.getsize(archive) < 40 << 20
    (tmp_path / "tmp").mkdir()
    script = ("import sys, fairseq_ext; from fairseq.models.transformer import TransformerModel as M; "
              "M.from_pretrained(sys.argv[1], checkpoint_file='model.pt', bpe='sentencepiece', source_lang='de', "
              "target_lang='en')")

    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, 256 << 20))

    env = {k: v for k, v in os.environ.items() if not k.startswith("FAIRSEQ_EXT_ARCHIVE_")}
    proc = subprocess.run([sys.executable, "-c", script, archive], capture_output=True, text=True, cwd=ROOT,
                          env=dict(env, TMPDIR=str(tmp_path / "tmp")), preexec_fn=limit, timeout=300)
    total = size + sum(os.path.getsize(os.path.join(DE_EN, src)) for _, src in MODEL)
    assert_one_line_error(proc, f"refusing to unpack model archive {archive}: member 'model/zeros.bin' brings what the "
                                f"archive unpacks to {total:,} bytes", "FAIRSEQ_EXT_ARCHIVE_MAX_BYTES",
                          "nothing was extracted")
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("kind", ["fifo", "device", "twice", "under a file"])
def test_other_members_a_model_archive_never_has_are_refused(tmp_path, tmp, kind):
    extra = {"fifo": [_member("model/pipe", kind=tarfile.FIFOTYPE)],
             "device": [_member("model/null", kind=tarfile.CHRTYPE)],
             "twice": [_member("model/model.pt", data=b"not a checkpoint")],
             "under a file": [_member("model/model.pt/x")]}[kind]
    message = _refused(_archive(tmp_path / "odd.tar.gz", extra), tmp)
    why = {"fifo": "is a device or FIFO", "device": "is a device or FIFO", "twice": "is given twice",
           "under a file": "is given twice, or as a file and as a directory"}[kind]
    assert why in message, message


def test_a_truncated_archive_is_one_line_and_leaves_nothing(tmp_path, tmp):
    archive = _archive(tmp_path / "model.tar.gz")
    with open(archive, "r+b") as f:
        f.truncate(os.path.getsize(archive) // 2)
    message = _refused(archive, tmp, match=r"model archive .* is truncated or corrupted \(.*\); download it again")
    assert "refusing" not in message


def _sparse_member(name, size):
    """Raw blocks of an old-GNU sparse member of ``size`` bytes (a hole, then one stored byte)."""
    info = tarfile.TarInfo(name)
    info.size, info.type = 1, tarfile.GNUTYPE_SPARSE
    head = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
    head[386:410] = tarfile.itn(size - 1, 12, tarfile.GNU_FORMAT) + tarfile.itn(1, 12, tarfile.GNU_FORMAT)
    head[483:495] = tarfile.itn(size, 12, tarfile.GNU_FORMAT)
    head[148:156] = b" " * 8
    head[148:155] = b"%06o\0" % tarfile.calc_chksums(bytes(head))[0]
    return bytes(head) + b"x".ljust(tarfile.BLOCKSIZE, b"\0")


def test_a_sparse_member_and_a_large_header_are_refused_before_they_are_read(tmp_path, tmp):
    """tarfile reads a pax header's data, and a sparse member's map, into memory: neither is in a model archive."""
    archive = _archive(tmp_path / "sparse.tar.gz", raw=_sparse_member("model/holes.bin", 1 << 20))
    with tarfile.open(archive) as t:  # a valid archive
        assert t.getmember("model/holes.bin").size == 1 << 20
    message = _refused(archive, tmp)
    assert "'model/holes.bin' is a sparse file" in message, message
    info, data = _member("model/notes.txt")
    info.pax_headers = {"comment": "x" * (2 << 20)}
    with tarfile.open(tmp_path / "pax.tar.gz", "w:gz", format=tarfile.PAX_FORMAT) as t:
        for name, src in MODEL:
            t.add(os.path.join(DE_EN, src), arcname=f"model/{name}")
        t.addfile(info, data)
    message = _refused(str(tmp_path / "pax.tar.gz"), tmp)
    assert re.search(r"is a header of 2,097,\d{3} bytes \(at most 1,048,576\)", message), message


def test_the_byte_cap_is_set_by_an_environment_variable(tmp_path, tmp, monkeypatch):
    archive = _archive(tmp_path / "model.tar.gz")
    monkeypatch.setenv("FAIRSEQ_EXT_ARCHIVE_MAX_BYTES", "1000000")
    message = _refused(archive, tmp)
    assert "FAIRSEQ_EXT_ARCHIVE_MAX_BYTES" in message and "1,000,000" in message, message
    monkeypatch.setenv("FAIRSEQ_EXT_ARCHIVE_MAX_BYTES", "a lot")
    with pytest.raises(FairseqExtError, match=r"FAIRSEQ_EXT_ARCHIVE_MAX_BYTES='a lot' is not a whole number"):
        _from_pretrained(archive)
    assert os.listdir(tmp) == []


def test_too_many_members_are_refused(tmp_path, tmp):
    """Default cap: an archive of more members (empty files) than a model has is refused, counted as it is read."""
    many = [_member(f"model/f{i}", data=b"") for i in range(archives.DEFAULT_MAX_MEMBERS)]
    archive = _archive(tmp_path / "many.tar.gz", many)
    message = _refused(archive, tmp)
    assert "FAIRSEQ_EXT_ARCHIVE_MAX_MEMBERS" in message and f"{archives.DEFAULT_MAX_MEMBERS:,}" in message, message


def test_a_zip_is_not_unpacked(tmp_path, tmp):
    """Nothing in the hub unpacks a zip (fairseq's loader only reads tar): a .zip model archive is one line."""
    archive = str(tmp_path / "model.zip")
    with zipfile.ZipFile(archive, "w") as z:
        for name, src in MODEL:
            z.write(os.path.join(DE_EN, src), f"model/{name}")
    with pytest.raises(FairseqExtError, match=r"model archive .*model\.zip is neither a directory nor a tar archive"
                                              r" .*; give the model's directory or its \.tar\.gz") as e:
        _from_pretrained(archive)
    assert "\n" not in str(e.value)
    assert os.listdir(tmp) == [] and sorted(os.listdir(tmp_path)) == ["model.zip", "tmp"]


def test_a_write_that_fails_part_way_is_one_line_and_removes_what_was_written(tmp_path, tmp):
    """A full disk while unpacking (here: files may not grow past 1 MB, model.pt is 4.8 MB): one line naming the
    temporary directory and TMPDIR, and that directory is removed at once (not at exit)."""
    import resource

    archive = _archive(tmp_path / "model.tar.gz")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        message = _refused(archive, tmp, match=r"could not unpack model archive .*model\.tar\.gz into .*fairseq_ext-"
                                               r"archive-.* \(OSError: \[Errno 27\] File too large\); free space "
                                               r"there or set TMPDIR")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(tmp) in message
