"""The product has no fault modes: the rules broken on purpose for the negative controls live in
`tests.cluster.broken_verifiers` (subclasses of the real `Verifier`), never behind a setting,
a flag or a parameter of the product's own code. The import contract "The product never
imports the tests" (`make lint`) keeps the product from reaching them; this keeps the settings
and branches from coming back.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from verifier.config import VerifierConfig

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("cluster", "drafter", "verifier")
FAULT_SWITCHES = re.compile(r"\.fault\b|\bfault\s*[:=]|verifier[-_]fault|noise_positions")
"""A fault read off a config, a fault field or argument, the audit's old hidden flag, the seed-exact
draw's old switch."""


def test_no_config_of_a_side_has_a_fault_field() -> None:
    assert not [f.name for f in dataclasses.fields(VerifierConfig) if "fault" in f.name]


def test_no_product_module_switches_on_a_fault() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FAULT_SWITCHES.search(line)
    ]
    assert found == []


def test_the_pattern_finds_the_switches_it_names() -> None:
    """The scan above can fail: each form it forbids is found."""
    for line in (
        "if self.config.fault == ACCEPT_ALL:",
        "    fault: str = NO_FAULT",
        'VerifierConfig(fault="accept_all")',
        'local.add_argument("--verifier-fault")',
        "gumbel_tokens(probs, seeds, positions, noise_positions=False)",
    ):
        assert FAULT_SWITCHES.search(line), line
    assert not FAULT_SWITCHES.search("except Exception:  # a listener's fault must not stop it")
