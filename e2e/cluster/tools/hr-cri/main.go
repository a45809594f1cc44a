// hr-cri: the few CRI calls the harness needs, because crictl (cri-tools) is
// not available from the Go module proxy here. Built by lib/containerd.sh
// against k8s.io/cri-api of the pinned Kubernetes release.
//
//	hr-cri -endpoint unix:///path/containerd.sock pods      # sandboxes
//	hr-cri -endpoint ... ps                                  # containers
//	hr-cri -endpoint ... images                              # images the kubelet can see
//	hr-cri -endpoint ... teardown                            # stop + remove every sandbox
//	hr-cri -endpoint ... inspecti IMAGE                      # crictl's JSON: status.id, status.repoTags
//
// Installed as crictl in kind's base image (e2e/kind/base-image.sh): kind
// runs `crictl inspecti` and `crictl images` on its nodes. Without
// -endpoint it reads runtime-endpoint from /etc/crictl.yaml, as crictl does
// (default unix:///run/containerd/containerd.sock).
//
// teardown goes through the CRI (StopPodSandbox/RemovePodSandbox) rather
// than `ctr tasks kill`, so the CNI DEL runs: pod IPs are released, veths and
// network namespaces removed, portmap/masquerade rules deleted.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtime "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func main() {
	endpoint := flag.String("endpoint", "", "CRI endpoint, e.g. unix:///run/containerd/containerd.sock")
	timeout := flag.Duration("timeout", 60*time.Second, "per-call timeout")
	flag.Parse()
	if *endpoint == "" {
		*endpoint = crictlEndpoint()
	}
	want := 1
	if flag.Arg(0) == "inspecti" {
		want = 2
	}
	if flag.NArg() != want {
		fmt.Fprintln(os.Stderr, "usage: hr-cri [-endpoint unix:///path.sock] pods|ps|images|teardown|inspecti IMAGE")
		os.Exit(2)
	}
	conn, err := grpc.NewClient(*endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fatal(err)
	}
	defer conn.Close()
	rt := runtime.NewRuntimeServiceClient(conn)
	im := runtime.NewImageServiceClient(conn)
	ctx := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), *timeout)
	}

	switch flag.Arg(0) {
	case "pods", "teardown":
		c, cancel := ctx()
		resp, err := rt.ListPodSandbox(c, &runtime.ListPodSandboxRequest{})
		cancel()
		if err != nil {
			fatal(err)
		}
		failed := 0
		for _, s := range resp.Items {
			name := s.Metadata.Namespace + "/" + s.Metadata.Name
			if flag.Arg(0) == "pods" {
				fmt.Printf("%-13.13s %-18s %s\n", s.Id, s.State, name)
				continue
			}
			c, cancel := ctx()
			if _, err := rt.StopPodSandbox(c, &runtime.StopPodSandboxRequest{PodSandboxId: s.Id}); err != nil {
				fmt.Fprintf(os.Stderr, "stop %s (%s): %v\n", s.Id[:13], name, err)
				failed++
			} else if _, err := rt.RemovePodSandbox(c, &runtime.RemovePodSandboxRequest{PodSandboxId: s.Id}); err != nil {
				fmt.Fprintf(os.Stderr, "remove %s (%s): %v\n", s.Id[:13], name, err)
				failed++
			} else {
				fmt.Printf("removed sandbox %.13s %s\n", s.Id, name)
			}
			cancel()
		}
		if failed > 0 {
			os.Exit(1)
		}
	case "ps":
		c, cancel := ctx()
		defer cancel()
		resp, err := rt.ListContainers(c, &runtime.ListContainersRequest{})
		if err != nil {
			fatal(err)
		}
		for _, ct := range resp.Containers {
			fmt.Printf("%-13.13s %-18s %-30s %s/%s\n", ct.Id, ct.State, ct.Image.GetImage(),
				ct.Labels["io.kubernetes.pod.namespace"], ct.Labels["io.kubernetes.pod.name"])
		}
	case "images":
		c, cancel := ctx()
		defer cancel()
		resp, err := im.ListImages(c, &runtime.ListImagesRequest{})
		if err != nil {
			fatal(err)
		}
		for _, i := range resp.Images {
			fmt.Printf("%v %s pinned=%v\n", i.RepoTags, i.Id, i.Pinned)
		}
	case "inspecti":
		c, cancel := ctx()
		defer cancel()
		resp, err := im.ImageStatus(c, &runtime.ImageStatusRequest{Image: &runtime.ImageSpec{Image: flag.Arg(1)}})
		if err != nil {
			fatal(err)
		}
		if resp.Image == nil {
			fatal(fmt.Errorf("no such image %q present", flag.Arg(1)))
		}
		// The fields of crictl's output that kind reads, under crictl's names.
		out, _ := json.MarshalIndent(map[string]any{"status": map[string]any{
			"id":          resp.Image.Id,
			"repoTags":    resp.Image.RepoTags,
			"repoDigests": resp.Image.RepoDigests,
			"size":        fmt.Sprint(resp.Image.Size_),
			"pinned":      resp.Image.Pinned,
		}}, "", "  ")
		fmt.Println(string(out))
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n", flag.Arg(0))
		os.Exit(2)
	}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "hr-cri:", err)
	os.Exit(1)
}

// crictlEndpoint is crictl's choice of endpoint: runtime-endpoint from
// /etc/crictl.yaml, else containerd's default socket.
func crictlEndpoint() string {
	if data, err := os.ReadFile("/etc/crictl.yaml"); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "runtime-endpoint:"); ok {
				return strings.TrimSpace(v)
			}
		}
	}
	return "unix:///run/containerd/containerd.sock"
}
