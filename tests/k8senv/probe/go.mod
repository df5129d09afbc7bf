// A tiny test workload for the real node (tests/integration/test_realnode.py); no dependencies.
// tests/k8senv/build.sh builds it and packs it into an OCI image archive with ../ociimage.
module ddiloco.local/k8senv/probe

go 1.26.0
