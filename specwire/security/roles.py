"""Which role each RPC needs: the one table the servers' authorization reads.

Two roles. A *reader* may read the registry (get, list, export, validate, history) and generate; an
*admin* may do all of that and also change the registry (create, update, tag, delete, import). Health
checks and reflection need no role, so probes and grpcurl work without credentials.

Every method of every service in `protos/` is listed here (a test reads the protos and fails on a
method missing from `METHOD_ROLES`), so a new RPC cannot ship unclassified. At run time an unlisted
method of the config service is a read (registry writes are the listed few) and an unlisted method
of any other service needs the admin role: closed until someone classifies it.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What a caller may do. An admin may do everything a reader may."""

    READER = "reader"
    ADMIN = "admin"

    def allows(self, needed: Role) -> bool:
        """Whether this role may call a method that needs `needed`."""
        return self is Role.ADMIN or needed is Role.READER


# Services that need no credentials: kubelet probes and grpcurl carry none.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

CONFIG_SERVICE = "specwire.config.v1.ConfigService"
TARGET_SERVICE = "specwire.target.v1.TargetService"
DRAFT_SERVICE = "specwire.draft.v1.DraftService"

# Registry writes: what a read-only registry refuses and an admin alone may call. DeleteTag is listed
# before it exists so that adding it cannot make it a read.
CONFIG_WRITES = ("CreateConfig", "UpdateConfig", "SetTag", "DeleteTag", "DeleteConfig", "ImportConfig")
CONFIG_READS = ("GetConfig", "ListConfigs", "ListConfigHistory", "ValidateConfig", "ExportConfig")

METHOD_ROLES: dict[str, Role] = {
    **{f"/{CONFIG_SERVICE}/{name}": Role.ADMIN for name in CONFIG_WRITES},
    **{f"/{CONFIG_SERVICE}/{name}": Role.READER for name in CONFIG_READS},
    # Generation, and what a target service says about its model.
    f"/{TARGET_SERVICE}/Generate": Role.READER,
    f"/{TARGET_SERVICE}/GenerateStream": Role.READER,
    f"/{TARGET_SERVICE}/GetModelInfo": Role.READER,
    # Scoring texts for a watermark reads the model's vocabulary and config only; it generates nothing.
    f"/{TARGET_SERVICE}/DetectWatermark": Role.READER,
    # Target services drafting: a reader token, the one the target sends to the draft service.
    f"/{DRAFT_SERVICE}/Draft": Role.READER,
}


def is_open(method: str) -> bool:
    """Whether `method` (`/package.Service/Method`) needs no credentials (health, reflection)."""
    return method.startswith(OPEN_SERVICES)


def required_role(method: str) -> Role | None:
    """The role `method` (`/package.Service/Method`) needs; None for the open services."""
    if is_open(method):
        return None
    # A method missing from the table (a new RPC nobody classified) fails closed: admin only.
    # tests/unit/test_access_policy.py fails on any RPC of the protos missing from it.
    return METHOD_ROLES.get(method, Role.ADMIN)


def is_registry_write(method: str) -> bool:
    """Whether `method` changes the config registry (refused by `--read-only`)."""
    return method.startswith(f"/{CONFIG_SERVICE}/") and required_role(method) is Role.ADMIN


def method_name(method: str) -> str:
    """`CreateConfig` for `/specwire.config.v1.ConfigService/CreateConfig`: what messages call it."""
    return method.rsplit("/", 1)[-1] or method
