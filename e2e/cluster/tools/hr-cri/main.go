// hr-cri: the few CRI calls the harness needs, because crictl (cri-tools) is
// not available from the Go module proxy here. Built by lib/containerd.sh
// against k8s.io/cri-api of the pinned Kubernetes release.
//
//	hr-cri -endpoint unix:///path/containerd.sock pods      # sandboxes
//	hr-cri -endpoint ... ps                                  # containers
//	hr-cri -endpoint ... images                              # images the kubelet can see
//	hr-cri -endpoint ... teardown                            # stop + remove every sandbox
//
// teardown goes through the CRI (StopPodSandbox/RemovePodSandbox) rather
// than `ctr tasks kill`, so the CNI DEL runs: pod IPs are released, veths and
// network namespaces removed, portmap/masquerade rules deleted.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtime "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func main() {
	endpoint := flag.String("endpoint", "", "CRI endpoint, e.g. unix:///run/containerd/containerd.sock")
	timeout := flag.Duration("timeout", 60*time.Second, "per-call timeout")
	flag.Parse()
	if *endpoint == "" || flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: hr-cri -endpoint unix:///path.sock pods|ps|images|teardown")
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
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n", flag.Arg(0))
		os.Exit(2)
	}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "hr-cri:", err)
	os.Exit(1)
}
