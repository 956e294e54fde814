"""``ChatSession`` (the KV cache kept across turns) and ``cortiq chat`` on tiny models.

Oracles: a fresh ``generate`` over the same rendered conversation (greedy: the same
tokens), the state's own forwarded-token counter, and a common prefix computed here.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine import Engine, SamplingConfig
from cortiq_engine.session import ChatSession, common_prefix
from formats.cmf import CmfFile, rewrite_header
from cortiq_engine.convert import convert_checkpoint
from tests.tiny import save_tiny

runner = CliRunner()
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Like templates that drop earlier reasoning: a past assistant turn renders shorter.
FORGETFUL = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<assistant>{{ m['content'][:2] }}\n"
    "{% else %}<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _with_template(src, dst, template):
    import shutil

    shutil.copy(src, dst)
    with CmfFile(dst) as f:
        header = dict(f.header)
    header["tokenizer"] = {**(header.get("tokenizer") or {}), "chat_template": template}
    rewrite_header(dst, header)
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    plain = root / "plain.cmf"
    convert_checkpoint(save_tiny("llama", root / "hf", max_position_embeddings=256), plain, quant="f32")
    return {
        "plain": plain,
        "chat": _with_template(plain, root / "chat.cmf", TEMPLATE),
        "forgetful": _with_template(plain, root / "forgetful.cmf", FORGETFUL),
    }


def _ids(eng, messages):
    return eng.tokenizer.encode(eng.tokenizer.apply_chat_template(messages), add_bos=False)


def _three_turns(eng, session, n=12):
    msgs = [{"role": "system", "content": "Be brief."}]
    out = []
    for user in ("Hello there", "And then?", "Thanks"):
        msgs.append({"role": "user", "content": user})
        ids = _ids(eng, msgs)
        before_cache = list(session.cached)
        before_fwd = session.state.forwarded
        turn = session.generate(ids, SamplingConfig(), max_tokens=n)
        out.append((ids, before_cache, session.state.forwarded - before_fwd, turn))
        msgs.append({"role": "assistant", "content": turn.result.text})
    return out


def test_session_forwards_only_the_new_suffix_and_equals_generate(tiny):
    eng = Engine.load(tiny["chat"], ctx=256)
    session = ChatSession(eng)
    for k, (ids, cache_before, forwarded, turn) in enumerate(_three_turns(eng, session)):
        res = turn.result
        expect_reuse = min(common_prefix(cache_before, ids), len(ids) - 1)
        assert turn.reused_tokens == expect_reuse and turn.forwarded_tokens == len(ids) - expect_reuse
        if k == 0:
            assert turn.reused_tokens == 0
        else:
            assert turn.reused_tokens > len(cache_before) // 2  # most of the conversation came from the cache
        # The state counts every token through forward(): the suffix, then the answer but its last token.
        assert forwarded == turn.forwarded_tokens + len(res.token_ids) - 1
        assert res.cache_length == len(ids) + len(res.token_ids) - 1
        fresh = eng.generate(ids, SamplingConfig(), max_tokens=12)
        assert res.token_ids == fresh.token_ids and res.text == fresh.text


def test_template_that_rerenders_earlier_turns_falls_back_to_the_common_prefix(tiny):
    eng = Engine.load(tiny["forgetful"], ctx=256)
    session = ChatSession(eng)
    turns = _three_turns(eng, session)
    ids2, cache2, _, turn2 = turns[1]
    # The first answer renders as two characters now: the cache serves up to where they differ.
    assert turn2.reused_tokens == common_prefix(cache2, ids2) < len(cache2)
    for ids, _, _, turn in turns:
        assert turn.result.token_ids == eng.generate(ids, SamplingConfig(), max_tokens=12).token_ids


def test_repetition_penalty_sees_the_cached_history(tiny):
    eng = Engine.load(tiny["chat"], ctx=256)
    cfg = SamplingConfig(repetition_penalty=1.3)
    session = ChatSession(eng)
    msgs = [{"role": "user", "content": "abc abc"}]
    session.generate(_ids(eng, msgs), cfg, max_tokens=8)
    msgs += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    ids = _ids(eng, msgs)
    turn = session.generate(ids, cfg, max_tokens=8)
    assert turn.reused_tokens > 0
    assert turn.result.token_ids == eng.generate(ids, cfg, max_tokens=8).token_ids


def test_context_full_is_a_turn_error_and_the_chat_goes_on(tiny):
    r = runner.invoke(
        app, ["chat", str(tiny["chat"]), "--ctx", "64", "-n", "4", "--json"], input="hi\n" + "x" * 80 + "\nok\n"
    )
    docs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [d["turn"] for d in docs] == [1, 2]  # the long turn failed, the next one ran
    assert "longer than the context" in r.stderr and "/reset" in r.stderr
    assert r.exit_code == 1  # a failed turn from a script is a failure
    assert docs[1]["reused_tokens"] > 0  # the failed turn did not spoil the cache


def test_evict_drops_the_oldest_turns(tiny):
    turns = "".join(f"turn {k} " + "y" * 20 + "\n" for k in range(4))
    r = runner.invoke(app, ["chat", str(tiny["chat"]), "--ctx", "96", "-n", "8", "--json", "--evict"], input=turns)
    assert r.exit_code == 0, r.output
    docs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert len(docs) == 4 and all(d["conversation_tokens"] <= 96 - 8 for d in docs)
    assert "dropped the" in r.stderr
    # Without --evict the same script runs out of context.
    r = runner.invoke(app, ["chat", str(tiny["chat"]), "--ctx", "96", "-n", "8", "--json"], input=turns)
    assert r.exit_code == 1 and "longer than the context" in r.stderr


def test_cli_commands_and_json_turns(tiny, tmp_path):
    saved = tmp_path / "conv.json"
    script = "\n".join(
        [
            "Hello there",
            f"/save {saved}",
            "/reset",
            "Hello there",
            "/system Be kind.",
            "Again",
            "/help",
            "/exit",
            "never",
        ]
    )
    r = runner.invoke(
        app,
        ["chat", str(tiny["chat"]), "-n", "6", "--json", "--system", "Be brief.", "--logprobs", "2"],
        input=script + "\n",
    )
    assert r.exit_code == 0, r.output
    docs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [d["user"] for d in docs] == ["Hello there", "Hello there", "Again"]
    assert docs[0]["token_ids"] == docs[1]["token_ids"]  # /reset: the same first turn again
    assert docs[1]["reused_tokens"] == 0
    assert docs[2]["reused_tokens"] == len("<system>Be ")  # the system prompt changed after these bytes
    assert all(len(t["top_logprobs"]) == 2 for t in docs[0]["tokens"])
    assert docs[0]["peak_rss_bytes"] > 0
    msgs = json.loads(saved.read_text())
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[2]["content"] == docs[0]["text"]
    # /load (and --load) continue that conversation: the same next answer either way.
    a = runner.invoke(app, ["chat", str(tiny["chat"]), "-n", "6", "--json", "--load", str(saved)], input="Next\n")
    b = runner.invoke(app, ["chat", str(tiny["chat"]), "-n", "6", "--json"], input=f"/load {saved}\nNext\n")
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]
    assert json.loads(a.stdout)["conversation_tokens"] > len("Next")


def test_cli_streams_text_and_reports_the_cache(tiny):
    r = runner.invoke(app, ["chat", str(tiny["chat"]), "-n", "5", "--logprobs", "2"], input="Hello there\nAnd then?\n")
    assert r.exit_code == 0, r.output
    stats = [ln for ln in r.stderr.splitlines() if ln.startswith("cached")]
    assert len(stats) == 2 and stats[0].startswith("cached 0 ·") and "tok/s" in stats[1]
    assert int(stats[1].split()[1]) > 0
    assert len([ln for ln in r.stderr.splitlines() if " | " in ln]) == 2 * 5  # a logprob line per answer token


@pytest.mark.parametrize(
    "args,stdin,needle",
    [
        (["plain"], "hi\n", "no chat template"),
        (["chat"], "/load nope.json\n", "no such chat session file"),
        (["chat"], "/save\n", "needs a FILE"),
    ],
)
def test_errors_are_one_line(tiny, args, stdin, needle):
    r = runner.invoke(app, ["chat", str(tiny[args[0]])], input=stdin)
    assert (
        r.exit_code == (2 if args == ["plain"] else 1) and "Traceback" not in r.output
    )  # refused: bad input; a failed turn: 1
    assert needle in r.stderr and r.stderr.strip().startswith("error:") and len(r.stderr.strip().splitlines()) == 1


def test_bad_load_file(tiny, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"role": "user"}')
    r = runner.invoke(app, ["chat", str(tiny["chat"]), "--load", str(bad)], input="hi\n")
    assert r.exit_code == 2 and "expected a JSON list" in r.stderr and "Traceback" not in r.output


# ------------------------------------------------------------------ speculative
@pytest.fixture(scope="module")
def mtp_chat(tmp_path_factory):
    import shutil

    from tests.mtp_tiny import save_tiny_mtp

    root = tmp_path_factory.mktemp("chat_mtp")
    convert_checkpoint(save_tiny_mtp("mimo", root / "src", n_layers=3), root / "m.cmf", quant="q8")
    _with_template(root / "m.cmf", root / "c.cmf", TEMPLATE)
    shutil.copy(root / "m.mtp.cmf", root / "c.mtp.cmf")
    return root / "c.cmf"


def test_speculative_chat_equals_plain_chat(mtp_chat):
    turns = "Hello there\nAnd then?\nThanks\n"
    # Threshold 0: the random draft layers are unsure of everything; every round drafts.
    spec = runner.invoke(
        app,
        ["chat", str(mtp_chat), "-n", "10", "--json", "-t", "1", "--logprobs", "3", "--mtp-threshold", "0"],
        input=turns,
    )
    plain = runner.invoke(
        app, ["chat", str(mtp_chat), "-n", "10", "--json", "-t", "1", "--logprobs", "3", "--no-mtp"], input=turns
    )
    assert spec.exit_code == 0 and plain.exit_code == 0, spec.output + plain.output
    s = [json.loads(ln) for ln in spec.stdout.splitlines()]
    p = [json.loads(ln) for ln in plain.stdout.splitlines()]
    assert len(s) == 3 and all("mtp" in d for d in s) and not any("mtp" in d for d in p)
    assert [d["token_ids"] for d in s] == [d["token_ids"] for d in p]
    assert [d["reused_tokens"] for d in s] == [d["reused_tokens"] for d in p]
    assert s[1]["reused_tokens"] > 0 and s[1]["mtp"]["rounds"] > 0
    # Verified rows carry the log-probabilities a plain decode step gives (row-exact verify).
    for ds, dp in zip(s, p):
        for ts, tp in zip(ds["tokens"], dp["tokens"]):
            assert [x["id"] for x in ts["top_logprobs"]] == [x["id"] for x in tp["top_logprobs"]]
            assert ts["logprob"] == pytest.approx(tp["logprob"], abs=1e-5)


def test_lookup_chat_equals_plain_chat(mtp_chat):
    """n-gram lookup drafts alone (--no-mtp --lookup): a conversation's later turns look up
    in the cached earlier ones too; every turn equals plain decoding."""
    turns = "la la la la\nla la la la la\nla la\n"
    spec = runner.invoke(
        app,
        ["chat", str(mtp_chat), "-n", "16", "--json", "-t", "1", "--no-mtp", "--lookup", "3", "--lookup-ngram", "1:3"],
        input=turns,
    )
    plain = runner.invoke(app, ["chat", str(mtp_chat), "-n", "16", "--json", "-t", "1", "--no-mtp"], input=turns)
    assert spec.exit_code == 0 and plain.exit_code == 0, spec.output + plain.output
    s = [json.loads(ln) for ln in spec.stdout.splitlines()]
    p = [json.loads(ln) for ln in plain.stdout.splitlines()]
    assert [d["token_ids"] for d in s] == [d["token_ids"] for d in p]
    assert [d["reused_tokens"] for d in s] == [d["reused_tokens"] for d in p] and s[1]["reused_tokens"] > 0
    assert all(d["mtp"]["source"] == "lookup" for d in s)
    assert sum(d["mtp"]["by_source"]["lookup"]["drafted"] for d in s if "by_source" in d["mtp"]) > 0
