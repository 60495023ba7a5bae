"""`bundle build --out` and `bundle keygen --out` are checked as output paths at parse time, as every
other --out is: a file where the directory goes, a directory or a device where a key file goes, or a
prefix that names a directory, is one line before any work (a key pair, a bundle) is made."""

import pytest

from appliance.cli import build_parser


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_build_out_is_a_directory(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = refusal(capsys, ["bundle", "build", "--profile", "cpu", "--out", str(tmp_path / "file")])
    assert "argument --out: " in err and "exists and is not a directory" in err, err


@pytest.mark.parametrize("prefix,expected", [("DIR/", "is not a path prefix"), ("", "is not a path prefix"),
                                             ("KEYDIR", "is a directory; give the file to write"),
                                             ("FILE/k", "is not a writable directory")])
def test_keygen_out_is_a_prefix_of_writable_files(tmp_path, capsys, prefix, expected):
    (tmp_path / "k.key").mkdir()
    (tmp_path / "file").write_text("x")
    prefix = {"DIR/": f"{tmp_path}/", "KEYDIR": str(tmp_path / "k"), "FILE/k": str(tmp_path / "file" / "k")}.get(
        prefix, prefix)
    err = refusal(capsys, ["bundle", "keygen", "--out", prefix])
    assert "argument --out: " in err and expected in err, err
    assert not list(tmp_path.glob("*.pub"))  # no half of a key pair made
