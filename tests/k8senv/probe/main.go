// probe: the k8senv real node's test workload, one static binary (the whole image).
//
//	probe serve [-addr :8080]          HTTP: GET / answers "probe <hostname>"; logs each request
//	probe get URL [-expect S] [-tries N] GET URL until it answers 200 (and contains S), one try a
//	                                   second (default 60); print it
//	probe kube-api [-url URL]          SelfSubjectReview with the pod's ServiceAccount token;
//	                                   prints "kube-api user=<username>"
//	probe write PATH TEXT              write TEXT to PATH, print "wrote PATH uid=U gid=G"
//	probe read PATH                    print "read PATH: <contents>"
//	probe sleep                        block until SIGTERM/SIGINT, then print "probe: terminated"
//
// Every command prints "probe: uid=U gid=G groups=[...]" first; exit status 0 on success.
package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

const saDir = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	if len(os.Args) < 2 {
		fail("usage: probe serve|get|kube-api|write|read|sleep ...")
	}
	groups, _ := os.Getgroups()
	fmt.Printf("probe: uid=%d gid=%d groups=%v\n", os.Getuid(), os.Getgid(), groups)
	cmd, args := os.Args[1], os.Args[2:]
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	switch cmd {
	case "serve":
		addr := fs.String("addr", ":8080", "listen address")
		_ = fs.Parse(args)
		serve(*addr)
	case "get":
		expect := fs.String("expect", "", "substring the body must contain")
		tries := fs.Int("tries", 60, "attempts, one per second")
		pos := parse(fs, args)
		if len(pos) != 1 {
			fail("usage: probe get URL [-expect S] [-tries N]")
		}
		get(pos[0], *expect, *tries)
	case "kube-api":
		url := fs.String("url", "", "apiserver URL (default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)")
		_ = fs.Parse(args)
		kubeAPI(*url)
	case "write":
		if len(args) != 2 {
			fail("usage: probe write PATH TEXT")
		}
		if err := os.WriteFile(args[0], []byte(args[1]), 0o644); err != nil {
			fail(err.Error())
		}
		st, err := os.Stat(args[0])
		if err != nil {
			fail(err.Error())
		}
		sys := st.Sys().(*syscall.Stat_t)
		fmt.Printf("wrote %s uid=%d gid=%d\n", args[0], sys.Uid, sys.Gid)
	case "read":
		if len(args) != 1 {
			fail("usage: probe read PATH")
		}
		b, err := os.ReadFile(args[0])
		if err != nil {
			fail(err.Error())
		}
		fmt.Printf("read %s: %s\n", args[0], b)
	case "sleep":
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
		fmt.Println("probe: sleeping")
		<-sigs
		fmt.Println("probe: terminated")
	default:
		fail("unknown command " + cmd)
	}
}

// parse parses flags before, between and after the positional arguments, which it returns.
func parse(fs *flag.FlagSet, args []string) []string {
	var pos []string
	for {
		_ = fs.Parse(args)
		if fs.NArg() == 0 {
			return pos
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

func serve(addr string) {
	host, _ := os.Hostname()
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Printf("probe: %s %s from %s\n", r.Method, r.URL.Path, r.RemoteAddr)
		fmt.Fprintf(w, "probe %s\n", host)
	})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fail(err.Error())
	}
	fmt.Printf("probe: serving on %s\n", ln.Addr())
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second}
	go func() {
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
		<-sigs
		fmt.Println("probe: terminated")
		os.Exit(0)
	}()
	fail(srv.Serve(ln).Error())
}

func get(url, expect string, tries int) {
	client := &http.Client{Timeout: 5 * time.Second}
	var last string
	for i := 0; i < tries; i++ {
		if i > 0 {
			time.Sleep(time.Second)
		}
		resp, err := client.Get(url)
		if err != nil {
			last = err.Error()
			continue
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 || !strings.Contains(string(body), expect) {
			last = fmt.Sprintf("status %d, body %q, err %v", resp.StatusCode, body, err)
			continue
		}
		fmt.Printf("get %s: %s", url, body)
		return
	}
	fail(fmt.Sprintf("get %s: no good answer after %d tries; last: %s", url, tries, last))
}

func kubeAPI(url string) {
	if url == "" {
		url = "https://" + net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"))
	}
	token, err := os.ReadFile(saDir + "/token")
	if err != nil {
		fail(err.Error())
	}
	ca, err := os.ReadFile(saDir + "/ca.crt")
	if err != nil {
		fail(err.Error())
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		fail("no certificate in " + saDir + "/ca.crt")
	}
	client := &http.Client{
		Timeout:   10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}},
	}
	body := []byte(`{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`)
	req, err := http.NewRequest("POST", url+"/apis/authentication.k8s.io/v1/selfsubjectreviews", bytes.NewReader(body))
	if err != nil {
		fail(err.Error())
	}
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		fail(err.Error())
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 201 && resp.StatusCode != 200 {
		fail(fmt.Sprintf("kube-api %s: status %d: %s", url, resp.StatusCode, out))
	}
	var review struct {
		Status struct {
			UserInfo struct {
				Username string `json:"username"`
			} `json:"userInfo"`
		} `json:"status"`
	}
	if err := json.Unmarshal(out, &review); err != nil {
		fail(err.Error())
	}
	fmt.Printf("kube-api %s user=%s\n", url, review.Status.UserInfo.Username)
}

func fail(msg string) {
	fmt.Println("probe: error:", msg)
	os.Exit(1)
}
