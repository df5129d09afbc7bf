// A tool that packs a few static files into a one-layer OCI image archive; no dependencies.
// tests/k8senv/build.sh uses it for the real node's pause and probe images.
module ddiloco.local/k8senv/ociimage

go 1.26.0
