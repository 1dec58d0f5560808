"""A custom reward for `reward.function`: token F1 of the answer, minus a small cost per search beyond the
first, with the F1 and the search count logged per data source.

    tandem train examples/searchr1/config/embedded_cpu_async.yaml \
        reward.function=examples/extending/reward_f1_search_cost.py:reward

The agent loop calls it once per trajectory with the keyword arguments it declares, from: answer (the
last <answer> the model wrote, or None), golden_answers, response_text (everything after the prompt,
tool text included), searches (the queries sent) and data_source. It returns a float, or a dict with a
float `score` (the reward) and other floats, logged as rollout/reward_extra/<name>/<data_source>.
"""

from tandemrl.agent.reward import f1

SEARCH_COST = 0.05


def reward(answer: str | None, golden_answers: list[str], searches: list[str], data_source: str) -> dict:
    answer_f1 = f1(answer, golden_answers)
    extra_searches = max(0, len(searches) - 1)
    return {
        "score": answer_f1 - SEARCH_COST * extra_searches,
        "f1": answer_f1,
        "searches": float(len(searches)),
    }
