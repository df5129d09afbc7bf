"""cli/errors.py's one-line form of pydantic errors: the field and the bad value, but never a
credential's value (a malformed token or key is still a secret)."""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationError

from ddiloco.cli.errors import one_line


class Settings(BaseModel):
    token: str = Field(min_length=40)
    tls_key_file: str = Field(pattern=r"^/")
    port: int


def test_a_bad_value_is_shown_but_a_credential_is_not() -> None:
    try:
        Settings(token="s3cret-value", tls_key_file="relative.pem", port="x")  # type: ignore[arg-type]
    except ValidationError as e:
        line = one_line(e)
    assert "\n" not in line
    assert "s3cret-value" not in line and "relative.pem" not in line
    assert line.count("(value not shown)") == 2
    assert "port: " in line and "(got 'x')" in line
