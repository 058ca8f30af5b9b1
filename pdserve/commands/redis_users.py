"""``pdserve redis-users``: Redis ACL users for pdserve's roles, with random passwords.

Writes ``ingress.password``, ``prefill.password``, ``admin.password`` (mode 0600) and
``users.acl`` (the passwords as SHA-256) into a folder: the ACL file for ``redis-server
--aclfile``, the password files for the replicas (``index.redis_users``) and the operator
(``pdserve keys --redis-user admin --redis-password-file admin.password``). On Kubernetes the
folder becomes the Secrets the overlays mount (``docs/deploy.md``). See
:mod:`cluster.redis_auth` for what each user may do.
"""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.apps import app


@app.command("redis-users")
def redis_users(
    out: Path = typer.Option(..., "--dir", help="Folder to write the files into."),
    force: bool = typer.Option(False, help="Replace passwords that exist already."),
) -> None:
    """Make the ingress, prefill and admin Redis users (random passwords) and their ACL file."""
    from cluster.redis_auth import ROLES, new_passwords, read_password, write_user_files

    have = [r for r in ROLES if (out / f"{r}.password").exists()]
    if have and not force:
        passwords = {r: read_password(out / f"{r}.password") for r in have}
        passwords |= new_passwords(tuple(r for r in ROLES if r not in have))
    else:
        passwords = new_passwords()
    paths = write_user_files(out, passwords)
    for role, path in sorted(paths.items()):
        typer.echo(f"{role}\t{path}")
