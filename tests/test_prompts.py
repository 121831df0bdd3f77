from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamicrubric.scoring.prompts import (
    dynamic_rubric_prompt,
    parse_rubric,
    response_order,
    split_chat_prompt,
    static_rubric_prompt,
)


def test_json_rubric():
    text = 'Sure! [{"criterion": "Answer is 5", "weight": 5}, {"text": "Shows work", "points": 2.6}] done'
    parsed = parse_rubric(text, max_items=8)
    assert parsed.status == "json"
    assert parsed.items == [{"text": "Answer is 5", "weight": 5}, {"text": "Shows work", "weight": 3}]


def test_json_list_cut_off_by_the_token_limit():
    text = 'Here: [{"criterion": "Answer is 56", "weight": 5}, {"criterion": "Explains why", "weight": 2}, {"crit'
    parsed = parse_rubric(text, max_items=8)
    assert parsed.status == "json"
    assert parsed.items == [{"text": "Answer is 56", "weight": 5}, {"text": "Explains why", "weight": 2}]


def test_weights_clamped_duplicates_dropped_count_capped():
    text = '[{"criterion": "A big one", "weight": 9}, {"criterion": "a big one.", "weight": 1}, ' + ", ".join(
        f'{{"criterion": "item {i}", "weight": -3}}' for i in range(10)
    )
    parsed = parse_rubric(text + "]", max_items=4)
    assert [i["weight"] for i in parsed.items] == [5, 1, 1, 1]
    assert [i["text"] for i in parsed.items] == ["A big one", "item 0", "item 1", "item 2"]


def test_numbered_lines_with_weights():
    text = """Here is the rubric:
1. (5) The final answer is 12
2. Uses correct units (weight: 2)
- [4] Explains the steps
* Mentions the formula - points 7
Thanks!"""
    parsed = parse_rubric(text, max_items=8)
    assert parsed.status == "lines"
    assert parsed.items == [
        {"text": "The final answer is 12", "weight": 5},
        {"text": "Uses correct units", "weight": 2},
        {"text": "Explains the steps", "weight": 4},
        {"text": "Mentions the formula", "weight": 5},
    ]


def test_unparseable_is_empty():
    for text in ["", "no list here at all", "[not json", '{"criterion": "x"}', "[1, 2, 3]"]:
        parsed = parse_rubric(text, max_items=5)
        assert parsed.items == [] and parsed.status == "empty"


@settings(max_examples=400, deadline=None)
@given(st.text(), st.integers(min_value=1, max_value=16))
def test_parser_never_raises(text, max_items):
    parsed = parse_rubric(text, max_items)
    assert len(parsed.items) <= max_items
    assert all(1 <= i["weight"] <= 5 and isinstance(i["weight"], int) and i["text"] for i in parsed.items)
    assert parsed.status in {"json", "lines", "empty"}
    assert (parsed.status == "empty") == (not parsed.items)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"criterion": st.text(), "weight": st.one_of(st.integers(), st.floats(), st.text(), st.none())}
        )
    )
)
def test_parser_on_arbitrary_json(entries):
    import json

    parsed = parse_rubric(json.dumps(entries), 8)
    assert all(1 <= i["weight"] <= 5 for i in parsed.items)


def test_generator_prompts_show_every_response():
    prompt = dynamic_rubric_prompt(
        "What is 2+3?", ["5", "six", "It is 5."], num_items=4, max_response_chars=100
    )
    assert "Response A:\n5" in prompt and "Response C:\nIt is 5." in prompt and "at most 4" in prompt
    assert "What is 2+3?" in static_rubric_prompt("What is 2+3?", 4)
    assert "Response" not in static_rubric_prompt("What is 2+3?", 4)


def test_response_order_is_seeded_permutation():
    a = response_order("p1", 8, seed=3)
    assert sorted(a) == list(range(8))
    assert a == response_order("p1", 8, seed=3)
    assert any(response_order("p1", 8, seed=s) != a for s in range(4, 10))


def test_each_rubric_sample_has_its_own_seeded_order_and_sample_0_the_sets():
    """Sample 0 reads the set's one order (a single-sample prompt is what it always was); the others
    each get an order of their own, a seeded permutation."""
    assert response_order("p1", 8, seed=3, sample=0) == response_order("p1", 8, seed=3)
    orders = [response_order("p1", 8, seed=3, sample=g) for g in range(4)]
    assert all(sorted(o) == list(range(8)) for o in orders)
    assert len({tuple(o) for o in orders}) == 4  # 8! orders: four seeded draws do not collide
    assert orders == [response_order("p1", 8, seed=3, sample=g) for g in range(4)]


def test_split_chat_prompt():
    def render(messages):
        return f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"

    prefix, suffix = split_chat_prompt(render, "Task: x\n", "Criterion: y?")
    assert prefix == "<|im_start|>user\nTask: x\n"
    assert suffix == "Criterion: y?<|im_end|>\n<|im_start|>assistant\n"
