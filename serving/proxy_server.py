"""Run the proxy as a process: ``python -m serving.proxy_server CONFIG.json [--host H] [--port P]``.

CONFIG.json is a :class:`serving.proxy.ProxyConfig` as JSON. The proxy binds 127.0.0.1 unless
``--host`` says otherwise; binding anything else without the config's ``api_key`` is logged as a
warning, since then the proxy asks its clients for no key. A key (the proxy's own, or a worker's)
that cannot be read stops it at once with the reason (``serving.api_keys``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn
from pydantic import ValidationError

from serving.api_keys import CredentialError
from serving.proxy import ProxyConfig, create_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serving.proxy_server", description=__doc__)
    parser.add_argument("config", type=Path, help="ProxyConfig JSON file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = ProxyConfig.model_validate_json(args.config.read_text())
    except (OSError, ValidationError) as exc:
        sys.exit(f"{args.config}: not a valid proxy configuration: {exc}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        logging.getLogger("turnscope.proxy").warning(
            "binding %s with no api_key: anyone who reaches the proxy can use the workers", args.host)
    try:
        app = create_app(config)
    except CredentialError as exc:
        sys.exit(f"{args.config}: {exc}")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
