// The real node's pod sandbox ("pause") program; no dependencies. tests/k8senv/build.sh builds it
// and packs it into an OCI image archive with ../ociimage.
module ddiloco.local/k8senv/pause

go 1.26.0
