"""Each format round-trips into the expected token ids and loss mask on the byte tokenizer
(token id == byte value; 256/257/258 = BOS/EOS/PAD)."""

import pytest

from memfit.data.examples import BAD, EMPTY, NO_RESPONSE, EncodeSpec, encode_chunk
from memfit.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, detect_format
from memfit.data.sources import DataError
from memfit.models.tokenizer import byte_tokenizer

BOS, EOS = 256, 257
M = -100


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def b(text: str) -> list[int]:
    return list(text.encode())


def encode(record, tok, seq_len=512, fmt="auto", fields=None, train_on_prompt=False):
    result = encode_chunk([("f.jsonl:1", record)], EncodeSpec(tok, seq_len, fmt, fields or {}, train_on_prompt))
    return result.examples, result.problems


def one(record, tok, **kw):
    examples, problems = encode(record, tok, **kw)
    assert problems == [] and len(examples) == 1
    return examples[0]["input_ids"], examples[0]["labels"]


def test_text_is_all_trainable(tok):
    ids, labels = one({"text": "hi there"}, tok)
    assert ids == [BOS] + b("hi there") + [EOS]
    assert labels == [M] + b("hi there") + [EOS]


def test_alpaca_masks_the_prompt(tok):
    ids, labels = one({"instruction": "Add.", "input": "1 + 2", "output": "3"}, tok)
    prompt = ALPACA_PROMPT.format(instruction="Add.", input="1 + 2")
    assert ids == [BOS] + b(prompt) + b("3") + [EOS]
    assert labels == [M] * (1 + len(b(prompt))) + b("3") + [EOS]
    ids, _ = one({"instruction": "Say hi.", "output": "hi"}, tok)  # no input: the shorter template
    assert ids == [BOS] + b(ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi.")) + b("hi") + [EOS]


def test_train_on_prompt_keeps_every_label(tok):
    ids, labels = one({"instruction": "Add.", "input": "1 + 2", "output": "3"}, tok, train_on_prompt=True)
    assert labels == ids


CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "bye"}]


def test_multi_turn_chat_trains_on_every_assistant_turn(tok):
    ids, labels = one({"messages": CONVERSATION}, tok)
    prompt1 = b("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n")
    reply1 = b("hello") + [EOS] + b("\n")
    prompt2 = b("<|user|>\nmore\n<|assistant|>\n")
    reply2 = b("bye") + [EOS] + b("\n")
    assert ids == [BOS] + prompt1 + reply1 + prompt2 + reply2
    assert labels == [M] * (1 + len(prompt1)) + reply1 + [M] * len(prompt2) + reply2


def test_sharegpt_maps_to_messages(tok):
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in CONVERSATION]}
    assert one(sharegpt, tok) == one({"messages": CONVERSATION}, tok)


def test_tokenizer_chat_template_is_used_when_present():
    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    ids, labels = one({"messages": CONVERSATION[1:3]}, tok)
    assert ids == [BOS] + b("[user]hi[assistant]hello")
    assert labels == [M] * (1 + len(b("[user]hi[assistant]"))) + b("hello")


def test_field_names_are_remapped(tok):
    remapped = one({"question": "Add.", "context": "1 + 2", "answer": "3"}, tok,
                   fields={"instruction": "question", "input": "context", "output": "answer"})
    assert remapped == one({"instruction": "Add.", "input": "1 + 2", "output": "3"}, tok)


def test_empty_and_prompt_only_examples_are_reported_not_trained(tok):
    examples, problems = encode({"text": ""}, tok)
    assert examples == [] and problems[0][0] == EMPTY and "f.jsonl:1" in problems[0][1]
    long_prompt = {"instruction": "x" * 100, "output": "y"}
    examples, problems = encode(long_prompt, tok, seq_len=32)
    assert examples == [] and problems[0][0] == NO_RESPONSE
    examples, _ = encode(long_prompt, tok, seq_len=200)
    assert len(examples) == 1  # fits: kept


def test_truncation_keeps_the_mask_aligned(tok):
    ids, labels = one({"instruction": "Add.", "output": "a long answer"}, tok, seq_len=40)
    assert len(ids) == len(labels) == 40
    assert all(label in (M, token) for token, label in zip(ids, labels))


def test_bad_records_name_where_and_what(tok):
    _, problems = encode({"messages": [{"role": "user", "content": "hi"}]}, tok)
    assert problems[0][0] == BAD and problems[0][1].startswith("f.jsonl:1:") and "assistant" in problems[0][1]
    _, problems = encode({"instruction": "x"}, tok, fmt="alpaca")
    assert "f.jsonl:1" in problems[0][1] and "'output'" in problems[0][1]
    _, problems = encode({"conversations": [{"from": "robot", "value": "x"}]}, tok)
    assert "robot" in problems[0][1]


def test_detect_format():
    assert detect_format({"text": "x"}) == "text"
    assert detect_format({"instruction": "x", "output": "y"}) == "alpaca"
    assert detect_format({"conversations": []}) == "chat"
    with pytest.raises(DataError, match="data.fields"):
        detect_format({"prompt": "x"})


def test_config_rejects_unknown_memfit_field_names():
    from memfit.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data.fields: unknown memfit field name\(s\) \['question'\]"):
        load_config(None, ["data.fields={question: instruction}"])
