"""Print the run config's reference: ``python -m megatron_rl.tools.config_reference > docs/config.md``."""

from __future__ import annotations

from megatron_rl.config.reference import document
from megatron_rl.trainer.schema import RunConfig

COMMAND = "python -m megatron_rl.tools.config_reference"


def main() -> None:
    print(document(RunConfig, COMMAND), end="")


if __name__ == "__main__":
    main()
