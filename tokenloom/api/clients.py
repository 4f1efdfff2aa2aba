"""``tokenloom chat`` and ``tokenloom complete``: small clients of a running server, like
``vllm chat`` / ``vllm complete`` (``--url``, ``--model-name``, ``--api-key``, one-shot
``--quick``, otherwise an interactive loop reading lines from standard input)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import openai
    from openai.types.chat import ChatCompletionMessageParam

DEFAULT_URL = "http://127.0.0.1:8000/v1"


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server's OpenAI base URL (default {DEFAULT_URL})")
    parser.add_argument("--model-name", default=None, help="the model to ask (default: the first one the server lists)")
    parser.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY, then $TOKENLOOM_API_KEY)")
    parser.add_argument("--max-tokens", type=int, default=None, help="maximum tokens per answer")
    parser.add_argument(
        "-q",
        "--quick",
        metavar="TEXT",
        default=None,
        help="send this one message or prompt, print the answer, and exit",
    )
    return parser


def _client(options: argparse.Namespace) -> tuple[openai.OpenAI, str]:
    import openai

    api_key = options.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TOKENLOOM_API_KEY") or "EMPTY"
    client = openai.OpenAI(base_url=options.url, api_key=api_key, max_retries=0)
    model = options.model_name or client.models.list().data[0].id
    return client, model


def _interact(prompt: str, ask: Callable[[str], None], quick: str | None, stdin: TextIO) -> int:
    if quick is not None:
        ask(quick)
        return 0
    interactive = stdin.isatty()
    while True:
        if interactive:
            print(prompt, end="", flush=True)
        line = stdin.readline()
        if not line:
            return 0
        if line.strip():
            ask(line.rstrip("\n"))


def _run(command: Callable[[list[str]], int], argv: list[str]) -> int:
    import openai

    try:
        return command(argv)
    except openai.APIConnectionError as exc:
        print(f"tokenloom: cannot reach the server: {exc} (is `tokenloom serve` running? see --url)", file=sys.stderr)
    except openai.APIStatusError as exc:
        print(f"tokenloom: the server answered {exc.status_code}: {exc.message}", file=sys.stderr)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 0
    return 1


def chat(argv: list[str], stdin: TextIO = sys.stdin) -> int:
    parser = _parser("tokenloom chat", "Chat with a running tokenloom (or any OpenAI-compatible) server.")
    parser.add_argument("--system-prompt", default=None, help="a system message starting the conversation")
    options = parser.parse_args(argv)

    def command(_argv: list[str]) -> int:
        client, model = _client(options)
        messages: list[ChatCompletionMessageParam] = (
            [{"role": "system", "content": options.system_prompt}] if options.system_prompt else []
        )

        def ask(text: str) -> None:
            messages.append({"role": "user", "content": text})
            stream = client.chat.completions.create(
                model=model, messages=messages, stream=True, max_tokens=options.max_tokens
            )
            reply = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    reply.append(chunk.choices[0].delta.content)
                    print(chunk.choices[0].delta.content, end="", flush=True)
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})

        return _interact("> ", ask, options.quick, stdin)

    return _run(command, argv)


def complete(argv: list[str], stdin: TextIO = sys.stdin) -> int:
    parser = _parser(
        "tokenloom complete", "Complete prompts with a running tokenloom (or any OpenAI-compatible) server."
    )
    options = parser.parse_args(argv)

    def command(_argv: list[str]) -> int:
        client, model = _client(options)

        def ask(text: str) -> None:
            stream = client.completions.create(model=model, prompt=text, stream=True, max_tokens=options.max_tokens)
            for chunk in stream:
                if chunk.choices:
                    print(chunk.choices[0].text, end="", flush=True)
            print()

        return _interact("> ", ask, options.quick, stdin)

    return _run(command, argv)
