#!/bin/sh
# One command for every AWS policy of a run: the files of k8s/aws/ and k8s/common/iam-policy.json
# with their placeholders filled from the environment, written to OUTDIR (the templates stay
# templates). Every placeholder must be set; the output is checked to hold none of them.
#
#   ACCOUNT_ID=123456789012 REGION=us-east-1 BUCKET=my-training-bucket PREFIX=checkpoints \
#   RUN_ID=gpt-8b-run-001 NAMESPACE=pretrain KMS_KEY_ID=1234abcd-... \
#   OIDC_PROVIDER=oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE \
#     k8s/aws/fill.sh /tmp/pretrain-aws
#
# Then (docs/runbook.md#aws-identities-and-the-bucket): aws iam create-role ... file://OUTDIR/trust-reader.json, etc.
set -eu
out=${1:?usage: k8s/aws/fill.sh OUTDIR; fix: name the directory to write the filled policies to}
here=$(cd "$(dirname "$0")" && pwd)
placeholders="ACCOUNT_ID REGION BUCKET PREFIX RUN_ID NAMESPACE KMS_KEY_ID OIDC_PROVIDER"
script=""
for name in $placeholders; do
    value=$(printenv "$name" || true)
    if [ -z "$value" ]; then
        echo "k8s/aws/fill.sh: $name is not set; fix: export $name (all of: $placeholders)" >&2
        exit 2
    fi
    case "$value" in *[\|\&\\]*)
        echo "k8s/aws/fill.sh: $name='$value' holds one of | & \\; fix: pass the plain value" >&2
        exit 2;;
    esac
    script="${script}s|$name|$value|g;"
done
mkdir -p "$out"
for f in "$here"/*.json "$here/../common/iam-policy.json"; do
    sed "$script" "$f" > "$out/$(basename "$f")"
done
for name in $placeholders; do
    if grep -l "$name" "$out"/*.json >/dev/null 2>&1; then
        echo "k8s/aws/fill.sh: $name left in $(grep -l "$name" "$out"/*.json | head -n1); fix: a value contains another placeholder's name" >&2
        exit 2
    fi
done
echo "k8s/aws/fill.sh: wrote $(ls "$out"/*.json | wc -l) policies to $out"
