"""A model whose tokenizer carries a chat template is asked in it: the prompt of finetuning,
evaluation and `ask` is the user's turn of the template, rendered as transformers renders it
(`apply_chat_template(..., add_generation_prompt=True)`), and `tokenizer.chat_template:
false` turns it off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe.data.tokenizer import load_tokenizer, specials
from moe.sql.prompts import prompt_text
from moe.sql.records import SqlPair
from tests.hf_fixture import make_tokenizer

# SmolLM2-Instruct's template (a system turn first), and Llama-3's habit of writing bos itself
SMOL = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WITH_BOS = (
    "{{ bos_token }}{% for message in messages %}[{{ message['role'] }}]\n"
    "{{ message['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]\n{% endif %}"
)
PAIR = SqlPair("How many singers?", "SELECT count(*) FROM singer", "x.sqlite", "singer(id int pk)")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder, vocab=400)
    return folder


@pytest.mark.parametrize("template", [SMOL, WITH_BOS], ids=["smollm2", "writes-bos"])
def test_the_prompt_is_the_templates_user_turn_as_transformers_renders_it(
    tmp_path: Path, tok_dir: Path, template: str
) -> None:
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((tok_dir / f).read_bytes())
    (folder / "chat_template.jinja").write_text(template)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": prompt_text(PAIR)}], tokenize=False, add_generation_prompt=True
    )
    tok = load_tokenizer(folder / "tokenizer.json")
    sp = specials(tok, folder / "tokenizer.json")
    assert sp.chat(prompt_text(PAIR)) == theirs
    assert prompt_text(PAIR).strip() in theirs and theirs != prompt_text(PAIR)
    # a template that writes bos itself gets no second one in front; the other keeps the
    # tokenizer's add_bos_token
    assert sp.prefix == ([] if "bos_token" in template else [sp.bos])


def test_prepare_carries_the_template_and_finetuning_asks_in_it(
    tmp_path: Path, tok_dir: Path
) -> None:
    from moe.recipes.finetune import sft_examples
    from tasks.config import Config
    from tasks.data import build_tokenizer

    (tok_dir / "chat_template.jinja").write_text(SMOL)
    try:
        cfg = Config()
        cfg.tokenizer.path = str(tok_dir / "tokenizer.json")
        work = tmp_path / "data"
        work.mkdir()
        path = build_tokenizer.fn(cfg, work)
        assert (work / "chat_template.jinja").read_text() == SMOL
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text(PAIR.to_json() + "\n")
        tok = load_tokenizer(path)
        sp = specials(tok, path)
        (ex,) = sft_examples(pairs, tok, sp)
        assert tok.decode(ex.prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
        assert "-- question: How many singers?" in tok.decode(ex.prompt)
        # off: the template is not carried, and the prompt is the plain text
        cfg.tokenizer.chat_template = False
        build_tokenizer.fn(cfg, work)
        assert not (work / "chat_template.jinja").exists()
        (ex,) = sft_examples(pairs, tok, specials(tok, path))
        assert tok.decode(ex.prompt).startswith("-- schema: singer(id int pk)")
    finally:
        (tok_dir / "chat_template.jinja").unlink()
    assert json.loads((work / "tokenizer_config.json").read_text())["eos_token"] == "</s>"


def test_ask_asks_in_the_template_as_finetuning_does(tmp_path: Path, tok_dir: Path) -> None:
    import sqlite3

    from moe.hf.model_dir import save_model_dir
    from moe.model.config import ModelConfig, MoEConfig
    from moe.model.transformer import MoETransformer
    from tasks.publish import ask_prompt

    folder = tmp_path / "model"
    tok = load_tokenizer(tok_dir / "tokenizer.json")
    save_model_dir(
        MoETransformer(ModelConfig(seq_len=256, n_layer=1, d_model=32), MoEConfig(),
                       tok.get_vocab_size()),
        folder,
    )  # fmt: skip
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((tok_dir / f).read_bytes())
    (folder / "chat_template.jinja").write_text(SMOL)
    db = tmp_path / "s.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE singer (id INTEGER PRIMARY KEY)")
    con.commit()
    con.close()
    ids = ask_prompt(folder, "How many singers?", db, tmp_path, max_new_tokens=16)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") and "-- question: How many singers?" in text
