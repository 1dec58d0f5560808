"""The reward plug-in (`reward.function`) and the tool plug-in (`tools.<name>.function`): loading, the
start-up checks and their one-line errors (through `tandem config show`), the built-in rewards, and the
example calculator driving a trajectory whose tool output is masked from the loss."""

from __future__ import annotations

import asyncio
import math
import textwrap
from pathlib import Path

import pytest

from tandemrl.agent.loop import run_trajectory
from tandemrl.agent.reward import RewardError, RewardFunction, exact_match, f1, load_reward
from tandemrl.agent.tools import AgentEnv, build_env, check_plugins
from tandemrl.cli import main
from tandemrl.config.agent import AgentLoopConfig
from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError
from tests.unit.test_agent_loop import PROMPT, FakeEngine, FakeSearch, check_alignment, masked_segments

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = f"{ROOT}/examples/extending/calculator_tool.py:calculate"
EXAMPLE_REWARD = f"{ROOT}/examples/extending/reward_f1_search_cost.py:reward"
CONFIG = ROOT / "examples" / "searchr1" / "config" / "embedded_cpu_async.yaml"


def reward_of(overrides: list[str]) -> RewardFunction:
    """The reward that the default config with `overrides` loads."""
    config = load_config(None, overrides)
    return load_reward(config.reward, config.agentloop.format_reward)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def plugins(tmp_path) -> Path:
    """A file of reward functions, good and broken."""
    path = tmp_path / "my_rewards.py"
    path.write_text(
        textwrap.dedent(
            """
            def length_bonus(answer, golden_answers, response_text, searches, data_source):
                return {"score": 0.5 + len(golden_answers[0]) / 100, "gold_chars": float(len(golden_answers[0]))}

            def answer_only(answer):
                return 1.0 if answer else 0.25

            def as_text(answer):
                return "1.0"

            def not_a_number(answer):
                return float("nan")

            def no_score(answer):
                return {"f1": 1.0}

            def wants_more(answer, prompt_ids):
                return 1.0

            def fails_later(answer, data_source):
                if data_source != "startup_check":
                    raise KeyError("no such source")
                return 1.0
            """
        )
    )
    (tmp_path / "broken_import.py").write_text(
        "import a_module_nobody_installed\ndef r(answer):\n    return 1.0\n"
    )
    return tmp_path


def test_builtin_exact_match_and_f1():
    assert exact_match("The Eiffel Tower", ["eiffel tower"]) == 1.0
    assert exact_match(None, ["x"]) == 0.0 and f1(None, ["x"]) == 0.0
    assert f1("Paris France", ["Paris"]) == pytest.approx(2 / 3)  # precision 1/2, recall 1
    assert f1("the city of Paris", ["Lyon", "Paris city"]) == pytest.approx(0.8)  # best gold: p 2/3, r 1
    assert f1("Rome", ["Paris"]) == 0.0


def test_reward_by_path_and_by_module(plugins):
    overrides = [f"reward.function={plugins / 'my_rewards.py'}:length_bonus"]
    reward = reward_of(overrides)
    assert reward("x", ["Paris"], "", [], "kb") == (0.55, {"gold_chars": 5.0})
    builtin_f1 = reward_of(["reward.function=tandemrl.agent.reward:f1"])
    assert builtin_f1("Paris France", ["Paris"], "", [], "kb")[0] == pytest.approx(2 / 3)
    only_answer = reward_of([f"reward.function={plugins / 'my_rewards.py'}:answer_only"])
    assert only_answer(None, ["Paris"], "", [], "kb") == (0.25, {})  # gets only the arguments it declares


def test_the_default_reward_is_exact_match_with_the_optional_format_score():
    plain = reward_of([])
    assert plain("paris", ["Paris"], "junk", [], "kb") == (1.0, {})
    formatted = reward_of(["agentloop.format_reward=true"])
    assert formatted("paris", ["Paris"], "junk <answer> paris </answer>", [], "kb")[0] == pytest.approx(0.8)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "{dir}/broken_import.py:r",
            "failed: ModuleNotFoundError: No module named 'a_module_nobody_installed'",
        ),
        ("{dir}/my_rewards.py:as_text", "returned str '1.0'; a reward is a float"),
        ("{dir}/my_rewards.py:not_a_number", "returned nan; a reward must be a finite number"),
        ("{dir}/my_rewards.py:no_score", "returned a dict without 'score'"),
        ("{dir}/my_rewards.py:wants_more", "the function requires 'prompt_ids'"),
        ("{dir}/my_rewards.py:missing", "has no attribute 'missing'"),
        ("{dir}/my_rewards.py", 'not of the form "module.path:callable"'),
        ("{dir}/no_such_file.py:r", "does not exist"),
        ("no_such_module_anywhere:r", "no module named 'no_such_module_anywhere'"),
    ],
)
def test_a_broken_reward_is_refused_at_start_up_in_one_line(plugins, capsys, spec, message):
    """`tandem config show` (and `tandem train`, which runs the same check before starting anything)."""
    code = main(["config", "show", str(CONFIG), f"reward.function={spec.format(dir=plugins)}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("tandem: configuration error: reward.function=")
    assert message in err, err


def test_tandem_train_refuses_a_broken_reward_before_starting_anything(plugins, capsys):
    code = main(["train", str(CONFIG), f"reward.function={plugins / 'my_rewards.py'}:not_a_number"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "returned nan" in err, err


def test_a_reward_failing_mid_run_names_the_key(plugins):
    reward = reward_of([f"reward.function={plugins / 'my_rewards.py'}:fails_later"])
    with pytest.raises(
        RewardError, match=r"reward.function=.*raised KeyError: 'no such source' \(data source 'kb'\)"
    ):
        reward("x", ["y"], "", [], "kb")


def test_format_reward_and_a_reward_function_do_not_combine():
    config = load_config(None, ["reward.function=tandemrl.agent.reward:f1", "agentloop.format_reward=true"])
    with pytest.raises(ConfigError, match="agentloop.format_reward=true"):
        load_reward(config.reward, config.agentloop.format_reward)


def test_tool_config_errors_name_the_key(plugins):
    cases = {
        "tools.calc.max_tokens=8": "tools.calc.function=None: is required",
        "tools.answer.function=m:f": "tools.answer.tag='answer': is already taken (by the Search-R1 format)",
        "tools.serach.topk=3": "did you mean tools.search?",
        "tools.calc.functon=m:f": "unknown key tools.calc.functon",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=None) as error:
            load_config(None, [override])
        assert message in str(error.value), (override, str(error.value))
    config = load_config(None, [f"tools.calc.function={plugins / 'my_rewards.py'}:wants_more"])
    with pytest.raises(ConfigError, match="must take the tool's input text as its one argument"):
        check_plugins(config.agentloop, config.tools, config.reward)


def test_the_example_calculator():
    from tandemrl.agent.plugin import load_callable

    calculate = load_callable(CALCULATOR, "tools.calculator.function")

    assert calculate("12 * (3 + 4)") == "84"
    assert calculate("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2 ** 1000", "x + 1"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_the_example_tool_is_called_and_its_output_masked(tokenizer):
    """The engine (a scripted fake of the engine process) writes a calculator call, then the answer;
    the env built from the config runs the example tool, whose result block has loss mask 0."""
    config = load_config(None, [f"tools.calculator.function={CALCULATOR}", "tools.calculator.max_tokens=24"])
    env = build_env(config.agentloop, config.tools, config.reward, FakeSearch())
    turns = [
        "<think> I will compute. </think>\n<calculator> 12 * (3 + 4) </calculator>",
        "<answer> 84 </answer>",
    ]
    engine = FakeEngine(tokenizer, turns)
    cfg = AgentLoopConfig(task_name="t", max_turns=2)
    prompt = PROMPT.__class__(prompt_id="c1", question="12 * 7?", golden_answers=["84"], data_source="math")
    traj = asyncio.run(run_trajectory(prompt, engine, env, tokenizer, cfg))
    check_alignment(traj, tokenizer)
    assert "</calculator>" in engine.requests[0]["sampling_params"]["stop"]
    assert traj.tool_calls == [{"tool": "calculator", "input": "12 * (3 + 4)"}] and traj.searches == []
    assert traj.answer == "84" and traj.reward == 1.0 and traj.num_tool_errors == 0
    segments = masked_segments(traj, tokenizer)
    assert [mask for mask, _ in segments] == [1, 0, 1]
    assert segments[1][1] == "\n\n<result>84</result>\n\n"  # the tool's output, never trained on
    assert (
        "<calculator> 12 * (3 + 4) </calculator>" in segments[0][1]
        and "<answer> 84 </answer>" in segments[2][1]
    )
    result_ids = tokenizer.encode(segments[1][1], add_special_tokens=False)
    assert engine.requests[1]["input_ids"][-len(result_ids) :] == result_ids  # the model saw the result


def test_a_failing_tool_answers_with_an_error_text_in_its_budget(tokenizer, caplog):
    config = load_config(None, [f"tools.calculator.function={CALCULATOR}", "tools.calculator.max_tokens=12"])
    env = build_env(config.agentloop, config.tools, config.reward, FakeSearch())
    turns = [
        "<calculator> open('/etc/passwd').read() and more words to cut </calculator>",
        "<answer> x </answer>",
    ]
    traj = asyncio.run(
        run_trajectory(PROMPT, FakeEngine(tokenizer, turns), env, tokenizer, AgentLoopConfig(max_turns=2))
    )
    check_alignment(traj, tokenizer)
    tool_text = masked_segments(traj, tokenizer)[1]
    assert tool_text[0] == 0 and tool_text[1].startswith("\n\n<result>tool calculator failed")
    assert (
        tool_text[1].endswith("</result>\n\n")
        and len(tokenizer.encode(tool_text[1], add_special_tokens=False)) <= 12
    )
    assert traj.num_tool_errors == 1
    assert sum("tools.calculator" in r.message for r in caplog.records) == 1


def test_custom_reward_scores_the_trajectory_with_its_extras(tokenizer, plugins):
    config = load_config(None, [f"reward.function={plugins / 'my_rewards.py'}:length_bonus"])
    env = build_env(config.agentloop, config.tools, config.reward, FakeSearch())
    turns = ["<search> capital </search>", "<answer> Rome </answer>"]
    traj = asyncio.run(
        run_trajectory(PROMPT, FakeEngine(tokenizer, turns), env, tokenizer, AgentLoopConfig(max_turns=2))
    )
    assert traj.em == 0.0 and traj.reward == pytest.approx(0.55) and traj.reward_extra == {"gold_chars": 5.0}


def test_a_bare_search_tool_is_the_builtin_env():
    env = AgentEnv.builtin(FakeSearch(), max_info_tokens=64)
    assert env.tags == ("search",) and env.stop_strings == ["</search>", "</answer>"]
    assert isinstance(env.reward, RewardFunction) and env.reward.fn is None
    assert math.isfinite(env.reward("Paris", ["paris"], "", [], "kb")[0])


def test_config_show_prints_the_example_plugins(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # its plug-in paths are relative to the repository root
    code = main(["config", "show", str(ROOT / "examples" / "extending" / "plugins.yaml")])
    out = capsys.readouterr().out
    assert code == 0
    assert (
        "  calculator:\n    function: examples/extending/calculator_tool.py:calculate\n    tag: calculator"
        in out
    )
    assert "function: examples/extending/reward_f1_search_cost.py:reward" in out


def test_the_example_reward(plugins):
    reward = reward_of([f"reward.function={EXAMPLE_REWARD}"])
    score, extra = reward("Paris", ["Paris"], "", ["a", "b", "c"], "kb")
    assert score == pytest.approx(1.0 - 2 * 0.05) and extra == {"f1": 1.0, "searches": 3.0}


def test_tandem_eval_refuses_a_broken_reward_before_starting_anything(plugins, capsys):
    code = main(["eval", str(CONFIG), f"reward.function={plugins / 'my_rewards.py'}:as_text"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "returned str '1.0'" in err, err


def test_tandem_demo_refuses_a_broken_reward_before_the_cold_start(plugins, capsys, monkeypatch):
    """`tandem demo reward.function=...`: the demo scores with the same function, so it checks it before
    its cold start and RL run, and before it prepares the embedded defaults (minutes on an empty home)."""
    import tandemrl.commands.demo as demo

    cold_starts, prepared = [], []
    monkeypatch.setattr(demo, "ensure_prepared", lambda: prepared.append(True))
    monkeypatch.setattr(demo, "ensure_cold_start", lambda config, mode: cold_starts.append(mode))
    code = main(
        ["demo", "--cold-start", "never", f"reward.function={plugins / 'my_rewards.py'}:not_a_number"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "reward.function=" in err and "returned nan" in err, err
    assert cold_starts == [] and prepared == []
    code = main(["demo", "--cold-start", "never", "data.rollout_batch_size=0"])  # a bad override, the same
    assert code == 2 and "data.rollout_batch_size" in capsys.readouterr().err and prepared == []


def test_async_tools_non_text_results_and_timeouts(tokenizer):
    """FunctionTool directly: an `async def` tool runs on the loop; a result that is not text and a call
    that never returns (past timeout_s) answer with an error text inside the result block."""
    from tandemrl.agent.tools import FunctionTool

    async def shout(text: str) -> str:
        return text.upper()

    async def never_returns(text: str) -> str:
        await asyncio.Event().wait()
        return text

    def a_number(text: str):
        return 42

    async def call(fn, timeout_s=10.0):
        return await FunctionTool("t", fn, "t", "result", 64, timeout_s).call("abc", tokenizer, 64)

    ok = asyncio.run(call(shout))
    assert (ok.text, ok.is_error) == ("\n\n<result>ABC</result>\n\n", False)
    wrong_type = asyncio.run(call(a_number))
    assert (
        wrong_type.is_error
        and wrong_type.text == "\n\n<result>tool t failed: TypeError: returned int, not str</result>\n\n"
    )
    stuck = asyncio.run(call(never_returns, timeout_s=0.01))
    assert stuck.is_error and stuck.text == "\n\n<result>tool t timed out after 0.01 s</result>\n\n"


@pytest.mark.parametrize("budget", [64, 20, 12, 3])
def test_a_tool_block_is_cut_to_its_budget_and_carries_its_ids(tokenizer, budget):
    """The block the loop appends: within the budget, its ids the block's own (the loop does not encode it
    again), the text cut by tokens; a budget that leaves no room for text gives the empty block."""
    from tandemrl.agent.tools import FunctionTool

    def echo(text: str) -> str:
        return text * 40

    tool = FunctionTool("t", echo, "t", "result", budget, 10.0)
    output = asyncio.run(tool.call("word ", tokenizer, budget))
    ids = tokenizer.encode(output.text, add_special_tokens=False)
    assert output.ids == ids and not output.is_error
    assert output.text.startswith("\n\n<result>") and output.text.endswith("</result>\n\n")
    if budget > tool.min_tokens(tokenizer) + 1:
        assert len(ids) <= budget and "word" in output.text
    else:
        assert output.text == "\n\n<result></result>\n\n"
