// hr-probe: the test workload of e2e/cluster/node-test.sh (not part of
// Headroom). Built with cgo, so it is dynamically linked against glibc and
// its image exercises e2e/images/build.sh's shared-library copying.
//
//	hr-probe hello [SECS]   print, write /tmp, sleep, exit 0
//	hr-probe alloc [MIB]    allocate and touch MIB-sized chunks until killed
//	hr-probe api            call the API server through the `kubernetes` Service
//	                        with the pod's service-account token
package main

/*
#include <unistd.h>
*/
import "C"

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

const sa = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	cmd := "hello"
	if len(os.Args) > 1 {
		cmd = os.Args[1]
	}
	arg := func(def int) int {
		if len(os.Args) > 2 {
			if n, err := strconv.Atoi(os.Args[2]); err == nil {
				return n
			}
		}
		return def
	}
	switch cmd {
	case "hello":
		hello(arg(2))
	case "alloc":
		alloc(arg(8))
	case "api":
		if err := api(); err != nil {
			fmt.Fprintln(os.Stderr, "hr-probe api:", err)
			os.Exit(1)
		}
	default:
		fmt.Fprintln(os.Stderr, "usage: hr-probe hello|alloc|api")
		os.Exit(2)
	}
}

func hello(secs int) {
	fmt.Printf("hello from hr-probe: uid=%d pid=%d (libc getuid)\n", int(C.getuid()), os.Getpid())
	if err := os.WriteFile("/tmp/hr-probe", []byte("ok"), 0o600); err != nil {
		fmt.Println("cannot write /tmp:", err)
		os.Exit(1)
	}
	fmt.Println("wrote /tmp/hr-probe")
	if err := os.WriteFile("/hr-probe", []byte("x"), 0o600); err != nil {
		fmt.Println("rootfs write refused:", err)
	}
	time.Sleep(time.Duration(secs) * time.Second)
	fmt.Println("done")
}

func alloc(stepMiB int) {
	var held [][]byte
	for total := stepMiB; total <= 16<<10; total += stepMiB {
		chunk := make([]byte, stepMiB<<20)
		for i := 0; i < len(chunk); i += 4096 {
			chunk[i] = 1 // touch every page so it is resident
		}
		held = append(held, chunk)
		fmt.Printf("allocated %d MiB\n", total)
		time.Sleep(50 * time.Millisecond)
	}
	fmt.Fprintln(os.Stderr, "allocated 16 GiB without being killed")
	os.Exit(1)
}

func api() error {
	host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
	if host == "" {
		return fmt.Errorf("KUBERNETES_SERVICE_HOST is not set")
	}
	token, err := os.ReadFile(sa + "/token")
	if err != nil {
		return err
	}
	caPEM, err := os.ReadFile(sa + "/ca.crt")
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("no certificates in %s/ca.crt", sa)
	}
	client := &http.Client{
		Timeout: 10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{
			RootCAs: pool,
			// The ClusterIP is dialled; the cert is checked for the Service name.
			ServerName: "kubernetes.default.svc",
		}},
	}
	base := "https://" + net.JoinHostPort(host, port)
	fmt.Println("API server:", base, "(from the kubernetes Service env)")
	do := func(method, path, body string) (int, string, error) {
		req, err := http.NewRequest(method, base+path, strings.NewReader(body))
		if err != nil {
			return 0, "", err
		}
		req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), err
	}
	code, body, err := do("GET", "/version", "")
	if err != nil {
		return err
	}
	fmt.Printf("GET /version -> %d %s\n", code, strings.Join(strings.Fields(body), " "))
	code, body, err = do("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
		`{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`)
	if err != nil {
		return err
	}
	fmt.Printf("POST selfsubjectreviews -> %d %s\n", code, body)
	if code != http.StatusCreated && code != http.StatusOK {
		return fmt.Errorf("unexpected status %d", code)
	}
	return nil
}
