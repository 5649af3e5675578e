"""Output paths are checked before a run starts: a clear error that names the flag and the path,
and nothing left behind by the check."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from ubatch.bench.outputs import check_outputs, file_problem, folder_problem

ROOT = Path(__file__).resolve().parents[1]


def test_a_report_path_is_checked_and_nothing_is_left_behind(tmp_path):
    assert file_problem(tmp_path / "new.json") is None
    assert not (tmp_path / "new.json").exists()
    (tmp_path / "old.json").write_text("kept")
    assert file_problem(tmp_path / "old.json") is None
    assert (tmp_path / "old.json").read_text() == "kept"
    assert file_problem(tmp_path) == "is a directory, not a file"
    assert file_problem(tmp_path / "missing" / "x.json") == "cannot be written: No such file or directory"


def test_a_folder_is_made_where_missing_and_refused_where_a_file_blocks_it(tmp_path):
    assert folder_problem(tmp_path / "a" / "b") is None
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("")
    assert folder_problem(tmp_path / "file" / "sub").startswith("cannot be made")


def test_check_outputs_names_the_flag_and_path(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="tool")
    check_outputs(parser, files={"--out": tmp_path / "x.json", "--plot": None}, folders={"--dir": tmp_path / "d"})
    with pytest.raises(SystemExit):
        check_outputs(parser, files={"--out": tmp_path / "no" / "x.json"})
    assert f"tool: error: --out '{tmp_path / 'no' / 'x.json'}' cannot be written" in capsys.readouterr().err


def test_a_script_refuses_its_output_before_measuring(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("link_bandwidth", ROOT / "scripts" / "link_bandwidth.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["link_bandwidth"] = module
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.main(["--out", str(tmp_path / "no" / "x.json")])
    assert "--out" in capsys.readouterr().err
