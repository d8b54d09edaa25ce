#!/usr/bin/env bash
# Runs one command on every host of a Cloud TPU slice (docs/tpu_pods.md), through
#   gcloud compute tpus tpu-vm ssh TPU --zone ZONE --worker=all --command '...'
# in the k3jax checkout of each host, with K3JAX_DISTRIBUTED=1 so that train.py joins the hosts
# with jax.distributed.initialize() (JAX reads the slice's hosts from the VM metadata).
#
#   scripts/launch_tpu_pod.sh --tpu NAME --zone ZONE [--project P] [--workdir DIR] [--env K=V]...
#                             [--print] -- COMMAND [ARG...]
#
#   --tpu        the TPU VM (slice) name, as in `gcloud compute tpus tpu-vm list`
#   --zone       its zone (e.g. us-east5-a for v5p, us-east5-b / europe-west4-a for v6e)
#   --project    the GCP project (default: gcloud's configured one)
#   --workdir    the k3jax checkout on every host (default: ~/k3jax)
#   --env K=V    an environment variable for the command (repeatable)
#   --print      print the gcloud command instead of running it
#
# Example (docs/tpu_pods.md): on every host of a v5p-64
#   scripts/launch_tpu_pod.sh --tpu k3-v5p --zone us-east5-a -- \
#       python train.py --config k3 --run-dir gs://BUCKET/runs/k3 mesh.expert=8 mesh.fsdp=-1
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

tpu="" zone="" project="" workdir="~/k3jax" print=0
envs=("K3JAX_DISTRIBUTED=1")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu) tpu="${2:?--tpu needs a value}"; shift 2 ;;
    --zone) zone="${2:?--zone needs a value}"; shift 2 ;;
    --project) project="${2:?--project needs a value}"; shift 2 ;;
    --workdir) workdir="${2:?--workdir needs a value}"; shift 2 ;;
    --env)
      [[ "${2:-}" == *=* ]] || { echo "error: --env takes KEY=VALUE, got '${2:-}'" >&2; exit 2; }
      envs+=("$2"); shift 2 ;;
    --print) print=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "error: unknown option '$1' (the command goes after --)" >&2; usage ;;
  esac
done
[[ -n "$tpu" ]] || { echo "error: --tpu is required" >&2; usage; }
[[ -n "$zone" ]] || { echo "error: --zone is required" >&2; usage; }
[[ $# -gt 0 ]] || { echo "error: no command given after --" >&2; usage; }

# The remote shell line: cd into the checkout, export the variables, run the command; every
# piece quoted for the remote shell (the workdir's leading ~ is left for it to expand).
remote="cd ${workdir/#\~/\$HOME} && env"
for e in "${envs[@]}"; do remote+=" $(printf '%q' "$e")"; done
for a in "$@"; do remote+=" $(printf '%q' "$a")"; done

cmd=(gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "$remote")
[[ -n "$project" ]] && cmd+=(--project "$project")

if [[ $print == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
