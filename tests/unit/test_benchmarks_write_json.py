"""benchmarks.write_json, the one writer of the benchmarks' JSON results: it makes the folder, writes the
object with the indent asked for and a closing newline, says where, and returns the path."""

from __future__ import annotations

import json

from benchmarks import write_json


def test_write_json_makes_the_folder_and_round_trips(tmp_path, capsys):
    result = {"name": "x", "runs": [1, 2.5, None], "nested": {"ok": True}}
    target = tmp_path / "a" / "b" / "result.json"
    written = write_json(str(target), result)
    assert written == target and target.is_file()
    text = target.read_text()
    assert json.loads(text) == result
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert text == json.dumps(result, indent=2) + "\n"
    assert capsys.readouterr().out == f"wrote {target}\n"


def test_write_json_honours_indent(tmp_path):
    result = {"a": [1, {"b": 2}]}
    one = write_json(tmp_path / "one.json", result, indent=1).read_text()
    four = write_json(tmp_path / "four.json", result, indent=4).read_text()
    assert one == json.dumps(result, indent=1) + "\n" and '\n "a"' in one
    assert four == json.dumps(result, indent=4) + "\n" and '\n    "a"' in four
    assert json.loads(one) == json.loads(four) == result
