"""Who may run admin commands (adapters load / unload / list, tenant weights) on a served model.

The threat model (docs/serving.md, "Admin commands"): anyone who reaches the inference ports can send requests.
With `--admin-token-file PATH`, an admin command must carry the file's token as the request parameter
`admin_token` (compared in constant time); without it, admin commands are open to every client, as a local or
trusted deployment wants. `--no-adapter-admin` turns them off altogether. Every refusal is logged with the op.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

from slora.backend.serving.options import ServingOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdminGuard:
    enabled: bool = True
    token: str | None = None  # None: no credential configured

    @classmethod
    def from_options(cls, options: ServingOptions) -> AdminGuard:
        token = read_token(Path(options.admin_token_file)) if options.admin_token_file else None
        return cls(options.adapter_admin, token)

    def check(self, given: str | None, op: str) -> None:
        """Raise PermissionError (Triton UNSUPPORTED) with the reason when `op` may not run with token `given`."""
        if not self.enabled:
            logger.warning("admin: %s refused: admin commands are disabled (adapter_admin=false)", op)
            raise PermissionError("adapter commands are disabled on this server (adapter_admin=false)")
        if self.token is None:
            return
        if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            logger.warning("admin: %s refused: %s admin token", op, "no" if given is None else "a wrong")
            raise PermissionError(
                f"adapter_command {op!r} needs the server's admin token in the request parameter 'admin_token'"
            )


def read_token(path: Path) -> str:
    """The token of an admin token file (surrounding whitespace dropped); refuses an empty or unreadable file."""
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"admin_token_file {str(path)!r} cannot be read: {exc}") from exc
    if not token:
        raise ValueError(f"admin_token_file {str(path)!r} is empty")
    return token
