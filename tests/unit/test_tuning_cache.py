"""The on-disk cache of the engine's kernel-tuning results (engine/tuning_cache.py): the same key is
answered from the file without timing again, another key is timed, and a broken or foreign file is
survived (warned, timed again, rewritten). The kernel timings themselves run on CUDA only
(tests/gpu/test_tuning_cache_gpu.py); here the timed work is a counting function."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pytest

from tandemrl.engine import tuning_cache


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.delenv(tuning_cache.CACHE_ENV, raising=False)
    monkeypatch.delenv(tuning_cache.CACHE_DIR_ENV, raising=False)  # the cache under this TANDEM_HOME
    return tmp_path


class Timer:
    """Counts how often the (expensive) tuning runs; returns a choice and its timings."""

    def __init__(self, choice):
        self.calls, self.choice = 0, choice

    def __call__(self):
        self.calls += 1
        return self.choice, {"a": 1.5, "b": 2.0}


KEY = {"gpu": "NVIDIA H200", "torch": "2.13.0", "batch": 256, "candidates": ["a", "b"]}


def test_the_same_key_is_read_from_the_cache_without_timing_again(home):
    timer = Timer({"8": 2})
    first = tuning_cache.cached("down_split", KEY, timer)
    second = tuning_cache.cached("down_split", dict(KEY), timer)
    assert timer.calls == 1
    assert first == ({"8": 2}, {"a": 1.5, "b": 2.0}, False)
    assert second == ({"8": 2}, {"a": 1.5, "b": 2.0}, True)
    files = list((home / "cache" / "kernel_tuning").iterdir())
    assert [f.name.startswith("down_split-") and f.suffix == ".json" for f in files] == [True]


@pytest.mark.parametrize("changed", [{"gpu": "NVIDIA A100"}, {"batch": 128}, {"candidates": ["a", "c"]}])
def test_a_different_key_is_timed(home, changed):
    timer = Timer(1)
    tuning_cache.cached("decode", KEY, timer)
    _, _, from_cache = tuning_cache.cached("decode", {**KEY, **changed}, timer)
    assert timer.calls == 2 and not from_cache
    _, _, from_cache = tuning_cache.cached("decode", KEY, timer)  # the first key's file is still there
    assert from_cache and timer.calls == 2


@pytest.mark.parametrize(
    "content",
    ["{not json", "", json.dumps({"format": 1, "key": {"other": 1}, "result": 3, "timings": {}}), "[1, 2]"],
)
def test_a_broken_or_foreign_file_is_warned_about_timed_again_and_rewritten(home, caplog, content):
    timer = Timer(7)
    path = tuning_cache.cache_path("prefill", KEY)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="tandemrl.engine.tuning_cache"):
        result, _, from_cache = tuning_cache.cached("prefill", KEY, timer)
    assert (result, from_cache, timer.calls) == (7, False, 1)
    assert any("unusable" in message for message in caplog.messages)
    assert json.loads(path.read_text())["result"] == 7  # rewritten whole
    assert tuning_cache.cached("prefill", KEY, timer)[2] and timer.calls == 1
    assert not list(path.parent.glob("*.tmp"))


@dataclass(frozen=True)
class Tile:
    block: int
    warps: int


def test_a_cached_choice_that_is_no_longer_a_candidate_is_timed_again(home):
    encode, decode = tuning_cache._config_codec((Tile(64, 4), Tile(32, 2)))
    timer = Timer(Tile(32, 2))
    assert tuning_cache.cached("decode", KEY, timer, encode, decode)[0] == Tile(32, 2)
    assert tuning_cache.cached("decode", KEY, timer, encode, decode)[:3:2] == (Tile(32, 2), True)
    encode, decode = tuning_cache._config_codec((Tile(64, 4),))  # Tile(32, 2) dropped from the list
    timer = Timer(Tile(64, 4))
    assert tuning_cache.cached("decode", KEY, timer, encode, decode)[0] == Tile(64, 4) and timer.calls == 1


def test_down_split_choices_must_cover_the_batch_sizes(home):
    encode, decode = tuning_cache._splits_codec([1, 16], (1, 2, 4))
    assert decode(encode({1: 1, 16: 4})) == {1: 1, 16: 4}
    with pytest.raises(ValueError):
        decode({"1": 1})  # a batch size missing
    with pytest.raises(ValueError):
        decode({"1": 1, "16": 3})  # 3 parts is not a candidate


def test_turned_off_it_times_every_call_and_writes_nothing(home, monkeypatch):
    monkeypatch.setenv(tuning_cache.CACHE_ENV, "0")
    timer = Timer(1)
    tuning_cache.cached("decode", KEY, timer)
    tuning_cache.cached("decode", KEY, timer)
    assert timer.calls == 2 and not (home / "cache").exists()


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    folder = tmp_path / "tuned"
    monkeypatch.setenv(tuning_cache.SHIPPED_DIR_ENV, str(folder))
    return folder


def test_shipped_choices_answer_a_fresh_machine_with_another_software_stack(home, shipped, tmp_path):
    timer = Timer(Tile(32, 2))
    codec = tuning_cache._config_codec((Tile(64, 4), Tile(32, 2)))
    tuning_cache.cached("decode", KEY, timer, *codec)
    written = tuning_cache.ship(tuning_cache.cache_dir(), shipped)
    assert len(written) == 1 and json.loads(written[0].read_text())["tuned_with"] == {"torch": "2.13.0"}
    fresh = tmp_path / "fresh-cache"  # another machine: an empty cache, a newer torch
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(tuning_cache.CACHE_DIR_ENV, str(fresh))
        before = dict(tuning_cache.stats)
        result, _, answered = tuning_cache.cached("decode", {**KEY, "torch": "2.14.0"}, timer, *codec)
        assert (result, answered, timer.calls) == (Tile(32, 2), True, 1)
        assert tuning_cache.stats["shipped"] == before["shipped"] + 1
        # another GPU, or a choice no longer among the candidates: timed on this machine
        tuning_cache.cached("decode", {**KEY, "gpu": "NVIDIA B200"}, timer, *codec)
        assert timer.calls == 2
        narrower = tuning_cache._config_codec((Tile(64, 4),))
        later = Timer(Tile(64, 4))
        assert tuning_cache.cached("decode", {**KEY, "torch": "2.15.0"}, later, *narrower)[0] == Tile(64, 4)
        assert later.calls == 1


def test_a_local_cache_entry_wins_over_a_shipped_one(home, shipped):
    tuning_cache.cached("prefill", KEY, Timer(5))
    tuning_cache.ship(tuning_cache.cache_dir(), shipped)
    tuning_cache.cache_path("prefill", KEY).unlink()
    assert tuning_cache.cached("prefill", KEY, Timer(6))[:3:2] == (5, True)  # the shipped one
    local = tuning_cache.cache_path("prefill", KEY)
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(json.dumps({"format": 1, "key": KEY, "result": 9, "timings": {}}))
    assert tuning_cache.cached("prefill", KEY, Timer(6))[0] == 9


def test_ship_command_reports_what_it_wrote(home, shipped, capsys):
    assert tuning_cache.main(["ship"]) == 1  # nothing cached yet
    tuning_cache.cached("decode", KEY, Timer(1))
    (tuning_cache.cache_dir() / "decode-broken.json").write_text("{oops")
    assert tuning_cache.main(["ship"]) == 0
    out = capsys.readouterr().out
    assert "shipped 1 kernel choice(s)" in out and len(list(shipped.glob("decode-*.json"))) == 1
