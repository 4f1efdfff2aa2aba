"""Request fields of issue 19 on the real `tokenloom serve smollm2` process, through the
`openai` client: beam search (completions and chat, `n` / `best_of` beams, ranking checked
against the returned logprobs, width 1 = greedy), `--seed` (the server samples exactly what an
offline engine with the same seed samples), per-request `logits_processors` (a registered
plugin processor and a qualified name allowed by `--logits-processor-pattern`), and the
refusals that name their field: streamed beam search, beam search with `stop`, a `priority`
under fcfs, a forced `tool_choice` without `tools`, a processor the pattern does not allow, and
a `--logits-processors` path that cannot be imported (the server does not start)."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from tests.e2e.conftest import API_KEY, REPO_ROOT, start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
SEED = 1234
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    running = start_server(
        [
            "smollm2",
            "--max-model-len",
            "1024",
            "--api-key",
            API_KEY,
            "--seed",
            str(SEED),
            # the built-in processors' plugin, loaded by name until the entry point is installed
            "--plugin",
            "tokenloom.builtin_plugins.logits_processors",
            "--logits-processor-pattern",
            r"tests\.e2e\..*",
        ],
        log_path,
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def token_ids_of(choice) -> list[int]:
    """The token ids of a completion choice asked with logprobs and return_tokens_as_token_ids."""
    return [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]


# -- --seed (first: nothing before it in this module samples at random) ---------------------------


def test_seed_flag_makes_unseeded_sampling_repeat_what_an_engine_with_that_seed_samples(client, smollm2_gguf):
    from tokenloom import LLM, SamplingParams

    prompts = [[1, 504, 1380, 6479, 18028, 359], [1, 19842, 2013, 253, 655]]
    # every sampling field explicit: only the seed decides the draws
    explicit = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, max_tokens=12)
    served = []
    for prompt in prompts:
        response = client.completions.create(
            model=MODEL,
            prompt=prompt,
            logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **explicit},
        )
        served.append(token_ids_of(response.choices[0]))
    llm = LLM(model=smollm2_gguf, max_model_len=1024, seed=SEED)
    params = SamplingParams(ignore_eos=True, **explicit)
    offline = [llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids for prompt in prompts]
    assert served == offline
    # the same requests again draw on from where the generator stands: other tokens, so the
    # equality above is the seed's doing and not a distribution too peaked to sample differently
    again = [llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids for prompt in prompts]
    assert again != offline


# -- beam search -----------------------------------------------------------------------------------


def beam(client, **extra):
    return client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        logprobs=1,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_tokens_as_token_ids": True, **extra},
    )


def test_beam_search_width_one_is_greedy(client):
    greedy = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    beams = beam(client, n=1)
    assert beams.choices[0].text == greedy.choices[0].text


def test_beam_search_returns_n_distinct_beams_ranked_by_their_logprobs(client):
    response = beam(client, n=3, length_penalty=1.0)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    beams = [token_ids_of(choice) for choice in response.choices]
    assert len({tuple(ids) for ids in beams}) == 3
    assert all(len(ids) == 6 and choice.finish_reason == "length" for ids, choice in zip(beams, response.choices))
    scores = [sum(choice.logprobs.token_logprobs) for choice in response.choices]
    assert scores == sorted(scores, reverse=True)
    # the most likely beam is at least as likely as greedy's path
    greedy = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    assert scores[0] >= sum(greedy.choices[0].logprobs.token_logprobs) - 1e-3
    assert response.usage.completion_tokens == 18


def test_beam_search_best_of_searches_wider_and_returns_n(client):
    response = beam(client, n=2, best_of=4)
    assert len(response.choices) == 2
    wide_best = sum(response.choices[0].logprobs.token_logprobs)
    narrow_best = sum(beam(client, n=2).choices[0].logprobs.token_logprobs)
    assert wide_best >= narrow_best - 1e-3


def test_chat_beam_search(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        n=2,
        extra_body={"use_beam_search": True},
    )
    assert len(response.choices) == 2
    assert response.choices[0].message.content != response.choices[1].message.content
    assert all(choice.finish_reason in ("stop", "length") for choice in response.choices)


def refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as error:
        call()
    return error.value.body


def test_streamed_beam_search_is_refused(client):
    body = refused(
        lambda: list(
            client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=4, stream=True, extra_body={"use_beam_search": True}
            )
        )
    )
    assert body["param"] == "stream" and "use_beam_search" in body["message"]
    body = refused(
        lambda: list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                stream=True,
                extra_body={"use_beam_search": True},
            )
        )
    )
    assert body["param"] == "stream"


def test_beam_search_with_a_field_it_cannot_honour_is_refused_by_name(client):
    body = refused(lambda: beam(client, n=2, stop=["."]))
    assert body["param"] == "stop" and "use_beam_search" in body["message"]


# -- logits processors ------------------------------------------------------------------------------


def test_a_qualified_logits_processor_allowed_by_the_pattern_runs_on_the_request(client):
    greedy = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    first = token_ids_of(greedy.choices[0])[0]
    banned = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=0,
        extra_body={
            "return_tokens_as_token_ids": True,
            "logits_processors": [{"qualname": "tests.e2e.ban_token_processor.BanTokens", "args": [first]}],
        },
    )
    assert first not in token_ids_of(banned.choices[0])


def test_the_registered_no_repeat_ngram_processor_prevents_repeated_bigrams(client):
    prompt = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0, echo=True)
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}

    def repeated_bigrams(response) -> int:
        """Generated tokens that complete a bigram already in the prompt or output before them."""
        ids = token_ids_of(response.choices[0])
        num_prompt = response.usage.prompt_tokens
        return sum(
            (ids[i - 1], ids[i]) in {tuple(ids[j : j + 2]) for j in range(i - 1)} for i in range(num_prompt, len(ids))
        )

    assert repeated_bigrams(client.completions.create(**kwargs, extra_body=extra)) > 0  # greedy repeats the prompt
    processed = client.completions.create(
        **kwargs,
        extra_body={**extra, "logits_processors": [{"qualname": "no_repeat_ngram", "kwargs": {"ngram_size": 2}}]},
    )
    assert processed.usage.completion_tokens == 16
    assert repeated_bigrams(processed) == 0


def test_a_logits_processor_the_pattern_does_not_allow_is_refused(client):
    body = refused(
        lambda: client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"logits_processors": ["os.system"]}
        )
    )
    assert body["param"] == "logits_processors" and "--logits-processor-pattern" in body["message"]
    body = refused(
        lambda: client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=2,
            extra_body={"logits_processors": [{"qualname": "no_repeat_ngram", "kwargs": {"ngram_size": 0}}]},
        )
    )
    assert body["param"] == "logits_processors" and "ngram_size" in body["message"]


def test_a_qualified_name_cannot_walk_out_of_the_module_the_pattern_allows(client, tmp_path):
    marker = tmp_path / "pwned"
    for qualname in (
        "tests.e2e.conftest:os.system",  # one allowed module, then attributes out of it
        "tests.e2e.conftest.os.system",
        "tests.e2e.conftest.subprocess",  # a module it imported
        "tests.e2e.ban_token_processor.LogitsProcessor",  # a class it imported, defined elsewhere
    ):
        processors = [{"qualname": qualname, "args": [f"touch {marker}"]}]
        body = refused(
            lambda processors=processors: client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"logits_processors": processors}
            )
        )
        assert body["param"] == "logits_processors", qualname
    assert not marker.exists()


# -- other refusals -------------------------------------------------------------------------------


def test_priority_under_fcfs_is_refused(client):
    body = refused(
        lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": 5})
    )
    assert body["param"] == "priority" and "--scheduling-policy priority" in body["message"]
    # 0 is the default and means nothing under fcfs: accepted
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"priority": 0}).choices


def test_a_forced_tool_choice_without_tools_is_refused(client):
    body = refused(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    assert body["param"] == "tool_choice" and "tools" in body["message"]


def test_an_unimportable_logits_processors_flag_stops_the_server_with_its_name():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenloom",
            "serve",
            "smollm2",
            "--max-model-len",
            "256",
            "--logits-processors",
            "no.such.Processor",
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
    )
    assert result.returncode != 0
    assert "--logits-processors" in result.stderr + result.stdout
    assert "no.such.Processor" in result.stderr + result.stdout
