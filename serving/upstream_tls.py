"""How turnscope verifies the TLS certificates of the workers it reaches over ``https://``.

A worker behind an ingress or a service mesh is reached at its ``url`` (``https://...``); the
topology's ``tls`` says which certificate authorities to trust (``ca_bundle``: a PEM file; default
the system's) and whether to verify at all (``verify: false`` only when told: an unverified
certificate is refused otherwise). Every client of a worker (the proxy's legs, the health and
credential checks, the metrics scraper) builds its verification from here.
"""

from __future__ import annotations

import functools
import ssl
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class UpstreamTLS(BaseModel):
    """TLS verification of ``https://`` workers: ``ca_bundle`` (a PEM file of trusted authorities;
    None: the system's) and ``verify`` (False accepts any certificate: for a test bench only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_bundle: str | None = None
    verify: bool = True

    def httpx_verify(self) -> ssl.SSLContext | bool:
        """httpx's ``verify=`` argument: False, or an SSL context trusting ``ca_bundle`` (or the
        system's authorities). Raises ValueError naming the bundle when it cannot be read."""
        if not self.verify:
            return False
        return _context(self.ca_bundle)


def raise_if_certificate_refused(exc: Exception, where: str) -> None:
    """Raise ValueError saying what to change when ``exc`` (a failed connection to ``where``, a
    worker's name and URL) is a TLS certificate that did not verify; return otherwise."""
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        raise ValueError(f"{where}: TLS certificate refused ({exc}); give the authority that signed it as "
                         "tls.ca_bundle in the topology (tls.verify: false accepts any)") from None


@functools.cache
def _context(ca_bundle: str | None) -> ssl.SSLContext:
    """One SSL context per bundle and process (loading a bundle takes tens of milliseconds)."""
    if ca_bundle is None:
        return ssl.create_default_context()
    if not Path(ca_bundle).is_file():
        raise ValueError(f"tls.ca_bundle: {ca_bundle} is not a readable file (a PEM bundle of trusted authorities)")
    try:
        return ssl.create_default_context(cafile=ca_bundle)
    except ssl.SSLError as exc:
        raise ValueError(f"tls.ca_bundle: {ca_bundle} holds no usable PEM certificate ({exc})") from None
