// ociimage writes a one-layer OCI image archive (an OCI image layout in a tar file, the format
// `ctr images import` and `podman load` read) holding the given files, reproducibly: fixed
// timestamps, owner root, sorted entries.
//
//	ociimage -o pause.tar -name ddiloco.local/k8senv/pause:v1 -entrypoint /pause ./pause=/pause
//
// Each FILE=DEST argument copies FILE into the image at DEST (mode 0755); -mkdir adds an empty
// world-writable, sticky directory (like /tmp).
package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path"
	"runtime"
	"sort"
	"strings"
	"time"
)

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int               `json:"size"`
	Platform    map[string]string `json:"platform,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

var epoch = time.Unix(0, 0).UTC()

func main() {
	out := flag.String("o", "", "output archive")
	name := flag.String("name", "", "image reference, e.g. ddiloco.local/k8senv/pause:v1")
	entrypoint := flag.String("entrypoint", "", "entrypoint, space-separated")
	user := flag.String("user", "", "default user (numeric uid[:gid])")
	var dirs multiFlag
	flag.Var(&dirs, "mkdir", "empty directory with mode 1777 (repeatable)")
	flag.Parse()
	if *out == "" || *name == "" || !strings.Contains(*name, ":") {
		fail("need -o OUT and -name REPO:TAG")
	}
	layer, err := buildLayer(flag.Args(), dirs)
	if err != nil {
		fail(err.Error())
	}
	blobs := map[string][]byte{}
	put := func(b []byte) string {
		d := fmt.Sprintf("sha256:%x", sha256.Sum256(b))
		blobs[d] = b
		return d
	}
	layerDigest := put(layer)
	cfg := map[string]any{
		"created":      epoch.Format(time.RFC3339),
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config": map[string]any{
			"Entrypoint": strings.Fields(*entrypoint),
			"Env":        []string{"PATH=/"},
			"User":       *user,
		},
		"rootfs":  map[string]any{"type": "layers", "diff_ids": []string{layerDigest}},
		"history": []map[string]string{{"created": epoch.Format(time.RFC3339), "created_by": "ociimage"}},
	}
	cfgJSON := mustJSON(cfg)
	manifest := map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config": descriptor{
			MediaType: "application/vnd.oci.image.config.v1+json",
			Digest:    put(cfgJSON), Size: len(cfgJSON),
		},
		"layers": []descriptor{{
			MediaType: "application/vnd.oci.image.layer.v1.tar",
			Digest:    layerDigest, Size: len(layer),
		}},
	}
	manJSON := mustJSON(manifest)
	tag := (*name)[strings.LastIndex(*name, ":")+1:]
	index := map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests": []descriptor{{
			MediaType: "application/vnd.oci.image.manifest.v1+json",
			Digest:    put(manJSON), Size: len(manJSON),
			Platform: map[string]string{"architecture": runtime.GOARCH, "os": "linux"},
			Annotations: map[string]string{
				"io.containerd.image.name":          *name,
				"org.opencontainers.image.ref.name": tag,
			},
		}},
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(p string, b []byte) {
		must(tw.WriteHeader(&tar.Header{Name: p, Mode: 0o644, Size: int64(len(b)), ModTime: epoch, Typeflag: tar.TypeReg}))
		_, err := tw.Write(b)
		must(err)
	}
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		must(tw.WriteHeader(&tar.Header{Name: d, Mode: 0o755, ModTime: epoch, Typeflag: tar.TypeDir}))
	}
	add("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
	add("index.json", mustJSON(index))
	digests := make([]string, 0, len(blobs))
	for d := range blobs {
		digests = append(digests, d)
	}
	sort.Strings(digests)
	for _, d := range digests {
		add("blobs/sha256/"+strings.TrimPrefix(d, "sha256:"), blobs[d])
	}
	must(tw.Close())
	must(os.WriteFile(*out, buf.Bytes(), 0o644))
}

// buildLayer returns an uncompressed layer tar with the files (SRC=DEST) and empty dirs.
func buildLayer(files []string, dirs []string) ([]byte, error) {
	type entry struct {
		dest, src string
		dir       bool
	}
	var entries []entry
	seen := map[string]bool{}
	addParents := func(p string) {
		for d := path.Dir(p); d != "/" && d != "."; d = path.Dir(d) {
			if !seen[d] {
				seen[d] = true
				entries = append(entries, entry{dest: d, dir: true})
			}
		}
	}
	for _, f := range files {
		src, dest, ok := strings.Cut(f, "=")
		if !ok || !path.IsAbs(dest) {
			return nil, fmt.Errorf("argument %q: want FILE=/DEST", f)
		}
		addParents(dest)
		entries = append(entries, entry{dest: path.Clean(dest), src: src})
	}
	for _, d := range dirs {
		addParents(d)
		if !seen[path.Clean(d)] {
			seen[path.Clean(d)] = true
			entries = append(entries, entry{dest: path.Clean(d), dir: true})
		}
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].dest < entries[j].dest })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		name := strings.TrimPrefix(e.dest, "/")
		if e.dir {
			mode := int64(0o755)
			for _, d := range dirs {
				if path.Clean(d) == e.dest {
					mode = 0o1777
				}
			}
			if err := tw.WriteHeader(&tar.Header{Name: name + "/", Mode: mode, ModTime: epoch, Typeflag: tar.TypeDir}); err != nil {
				return nil, err
			}
			continue
		}
		b, err := os.ReadFile(e.src)
		if err != nil {
			return nil, err
		}
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o755, Size: int64(len(b)), ModTime: epoch, Typeflag: tar.TypeReg}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(b); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	must(err)
	return b
}

func must(err error) {
	if err != nil {
		fail(err.Error())
	}
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, "ociimage:", msg)
	os.Exit(2)
}
