"""How a pod gets the model: `builtin:` needs nothing, `pvc://` mounts the claim read-only,
`hf:` downloads into a cache volume with an init container."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton_operator.builders.common import Manifest, container_security_context
from baton_operator.models import ModelSpec, parse_source

MODEL_MOUNT = "/model"
MODEL_VOLUME = "model"
DOWNLOAD_CONTAINER = "model-download"
HF_TOKEN_ENV = "HF_TOKEN"

#: The init container's program (argv: repo, revision or "", destination, allow-patterns...). It
#: uses huggingface_hub, which the engine and router images carry (tokenizers depends on it).
DOWNLOAD_SCRIPT = (
    "import sys\n"
    "from huggingface_hub import snapshot_download\n"
    "repo, revision, dest, *patterns = sys.argv[1:]\n"
    "snapshot_download(repo, revision=revision or None, local_dir=dest, allow_patterns=patterns or None)\n"
)
#: What the router needs: the tokenizer and chat template, not the weights.
TOKENIZER_PATTERNS = ("*.json", "*.jinja", "tokenizer.model", "*.txt")


@dataclass(frozen=True)
class ModelMount:
    """The model reference a container is given, and what the pod needs to make it exist."""

    reference: str  # --model / --tokenizer value
    volumes: list[Manifest] = field(default_factory=list)
    mounts: list[Manifest] = field(default_factory=list)
    init_containers: list[Manifest] = field(default_factory=list)


def model_mount(model: ModelSpec, image: str, pull_policy: str, tokenizer_only: bool = False) -> ModelMount:
    source = parse_source(model.source)
    if source.kind == "builtin":
        return ModelMount(reference=source.ref)
    mount = {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True}
    if source.kind == "pvc":
        volume = {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": source.ref, "readOnly": True},
        }
        reference = f"{MODEL_MOUNT}/{source.path}" if source.path else MODEL_MOUNT
        return ModelMount(reference=reference, volumes=[volume], mounts=[mount])
    empty_dir: Manifest = {}
    if model.cache_size is not None:
        empty_dir["sizeLimit"] = str(model.cache_size)
    env: list[Manifest] = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"}]
    if model.hf_token_secret is not None:
        env.append(
            {
                "name": HF_TOKEN_ENV,
                "valueFrom": {
                    "secretKeyRef": {"name": model.hf_token_secret.name, "key": model.hf_token_secret.key}
                },
            }
        )
    patterns = list(TOKENIZER_PATTERNS) if tokenizer_only else []
    download = {
        "name": DOWNLOAD_CONTAINER,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["python", "-c", DOWNLOAD_SCRIPT],
        "args": [source.ref, model.revision or "", MODEL_MOUNT, *patterns],
        "env": env,
        "securityContext": container_security_context(),
        "volumeMounts": [
            {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    return ModelMount(
        reference=MODEL_MOUNT,
        volumes=[{"name": MODEL_VOLUME, "emptyDir": empty_dir}],
        mounts=[mount],
        init_containers=[download],
    )
