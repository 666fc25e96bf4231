"""The `streamchat` command: serve, generate, eval, chat, feed, fleet.

Owns argument parsing and turning errors into one clear line and an exit
code. Imports nothing heavy at module level, so `streamchat chat` starts fast
and never imports torch.
"""

from __future__ import annotations

import argparse
import sys

from streamchat.config import ConfigError


def _generate_parser(sub) -> None:
    from streamchat import settings

    p = sub.add_parser("generate", help="generate a reply to one prompt (no daemon)")
    p.add_argument("prompt", help="the user message")
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    sampling = p.add_argument_group("sampling", "unset: the model's defaults, as the daemon serves them")
    sampling.add_argument("--temperature", type=float, help="0 is greedy")
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int, help="0 is off")
    sampling.add_argument("--min-p", type=float, help="0 is off")
    sampling.add_argument("--frequency-penalty", type=float, help="in [-2, 2]; 0 is off")
    sampling.add_argument("--presence-penalty", type=float, help="in [-2, 2]; 0 is off")
    sampling.add_argument("--repetition-penalty", type=float, help="in (0, 10]; 1 is off")
    sampling.add_argument("--seed", type=int)
    settings.add_flags(p, ("model", "cache"))
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    from streamchat import settings
    from streamchat.llm import LLM
    from streamchat.model.sampling_params import DEFAULT_PARAMS, SAMPLING_FIELDS, resolve_params

    if not args.prompt.strip():
        raise ConfigError("the prompt is empty")
    if args.max_tokens <= 0:
        raise ConfigError(f"--max-tokens must be positive, got {args.max_tokens}")
    flags = {name: getattr(args, name) for name in SAMPLING_FIELDS}
    try:
        resolve_params(DEFAULT_PARAMS, {}, flags)  # refuse a bad flag before the model loads
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    llm = LLM(settings.load(args))
    params = resolve_params(llm.default_params, {}, flags)
    [reply] = llm.chat([args.prompt], args.max_tokens, args.system, params)
    print(reply.text)
    return 0


def _serve_parser(sub) -> None:
    from streamchat import settings

    p = sub.add_parser("serve", help="run the daemon")
    settings.add_flags(p)
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    p.add_argument("--log-format", default="text", choices=("text", "json"),
                   help="json: one object per line, with each record's fields (for log collectors)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args) -> int:
    from streamchat import logs, settings
    from streamchat.server.app import run

    config = settings.load(args)  # a bad setting fails before any log line
    logs.setup(args.log_level, args.log_format, fields={"daemon_id": config.fleet.daemon_id})
    return run(config, args.log_level, args.log_format)


def _fleet_parser(sub) -> None:
    from streamchat import settings

    p = sub.add_parser("fleet", help="list the fleet's daemons, whether each is alive, the sessions each holds")
    settings.add_flags(p, ("store", "fleet"), skip=("daemon_id", "heartbeat_s"))
    p.add_argument("--json", action="store_true", help="one JSON array, a daemon an object (for machines)")
    p.set_defaults(func=_cmd_fleet)


def _cmd_fleet(args) -> int:
    """Read the registry (never migrating or creating anything); a daemon silent for --lease-s is stale."""
    from streamchat import settings
    from streamchat.store import Store, StoreError
    from streamchat.store.report import fleet_json, fleet_table
    from streamchat.store.store import utc_now

    config = settings.load(args)
    _check_store_exists(config.store.url)
    with Store(config.store.url) as store:
        try:
            _check_store_current(store)
            states = store.daemons.fleet(stale_s=config.fleet.lease_s)
        except StoreError as exc:
            print(f"streamchat: error: {exc}", file=sys.stderr)
            return 1
    print(fleet_json(states) if args.json else fleet_table(states, utc_now()))
    return 0


def _check_store_exists(url: str) -> None:
    from sqlalchemy.engine import make_url

    from streamchat.store.database import is_memory_sqlite, sqlite_file

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and (is_memory_sqlite(parsed) or not sqlite_file(parsed).exists()):
        raise ConfigError(f"no store at {url} (give the fleet's --database-url)")


def _check_store_current(store) -> None:
    from streamchat.store.errors import translate_errors
    from streamchat.store.migrate import current_revision, head_revision

    with translate_errors():  # a server that is down: StoreError, as for the query itself
        have, want = current_revision(store.engine), head_revision()
    if have != want:
        url = store.engine.url.render_as_string(hide_password=True)
        raise ConfigError(f"the store at {url} is at revision {have or 'none'}, not {want}: "
                          "start a daemon of this version on it to migrate it")


def _eval_parser(sub) -> None:
    try:
        from streamchat.evaluate import add_parser
    except ImportError:
        return
    add_parser(sub)


def _client_parsers(sub) -> None:
    try:
        from streamchat.client.cli import add_commands
    except ImportError:
        return
    add_commands(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamchat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    _generate_parser(sub)
    _fleet_parser(sub)
    _eval_parser(sub)
    _client_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"streamchat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # known failures carry a message a person can act on
        from streamchat.errors import user_message

        msg = user_message(exc)
        if msg is None:
            raise
        print(f"streamchat: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
