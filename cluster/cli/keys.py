"""`tandem keys new --tenant NAME`: a new API key, and the config lines that admit it.

The key is printed once and never stored; the config keeps only its SHA-256
(`cluster.api.tenants`). Hand the key to the tenant, paste the lines into `auth.tenants`.
"""

from __future__ import annotations

import argparse
from typing import Any

from cluster.api.tenants import TenantConfig, hash_api_key, new_api_key


def add_to(commands: Any) -> None:
    keys = commands.add_parser("keys", help="make API keys for tenants")
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = actions.add_parser("new", help="print a new API key and its tenant config")
    new.add_argument("--tenant", required=True, help="the tenant's name")
    new.set_defaults(handler=new_command)


def new_command(args: argparse.Namespace) -> int:
    key = new_api_key()
    tenant = TenantConfig(args.tenant, hash_api_key(key))  # validates the name
    print(f"API key for tenant {tenant.name} (shown once; clients send it as a Bearer token):")
    print(f"  {key}")
    print("Add to the config under auth.tenants:")
    print(f"  - name: {tenant.name}")
    print(f"    key_sha256: {tenant.key_sha256}")
    print(f"    max_concurrent: {tenant.max_concurrent}")
    print("    tokens_per_minute: 60000      # optional")
    print("    max_tokens_per_request: 1024  # optional")
    print(f"    weight: {tenant.weight}")
    return 0
