"""What a corpus is read from: a file of ``data.path`` that does not look like text is refused,
naming what was read; text in any one-byte encoding or UTF-8 never is."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from diloco.data.source import read_text
from diloco.errors import DataError

REPO = Path(__file__).resolve().parents[3]
ACCENTED = "Le cœur a ses raisons que la raison ne connaît point. Über Größe, Ærø, Съешь же ещё. \n"


@pytest.mark.parametrize(
    "text",
    [
        (REPO / "data" / "tinyshakespeare.txt").read_bytes(),
        (REPO / "diloco" / "cli.py").read_bytes(),
        (ACCENTED * 2000).encode("utf-8"),
        ("Le cœur a ses raisons. Über Größe. \f\t\x1b[1mgras\x1b[0m b\bb\r\n" * 2000).encode("latin-1", "replace"),
        ("Съешь же ещё этих мягких французских булок, да выпей чаю.\n" * 2000).encode("cp1251"),
    ],
    ids=["repo-data", "python-source", "utf8-accents", "latin1-controls-text-uses", "cp1251"],
)
def test_text_in_any_one_byte_encoding_or_utf8_is_read_as_it_is(tmp_path, text):
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    assert read_text(path, str(path)) == text
    assert read_text(path, str(path), cap=100) == text[:100]


def test_a_binary_file_is_refused_with_the_share_of_control_bytes_read(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(random.Random(0).randbytes(200_000))
    with pytest.raises(DataError) as info:
        read_text(path, str(path))
    assert str(info.value) == (
        f"data.path={path} does not look like text: 10% of its first 64 KiB are control bytes such as NUL, "
        "which text does not hold (a binary file?); point data.path at a text file"
    )


def test_a_binary_file_among_a_folders_text_files_is_named_with_the_folder(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"\x00\x01" * 100)
    with pytest.raises(DataError) as info:
        read_text(tmp_path / "b.txt", str(tmp_path))
    assert str(info.value).startswith(
        f"data.path={tmp_path}: {tmp_path / 'b.txt'} does not look like text: 100% of its 200 bytes"
    )
