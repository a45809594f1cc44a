// peers: one neutral harness that times two training operators on the same
// API server (`make bench-peers`, e2e/peers/bench-peers.sh).
//
// For each operator and round it makes a fresh namespace, starts the
// operator as a child process scoped to it (the same admin kubeconfig for
// both), and then, with one pod watch open on the namespace:
//
//  1. a warm-up job: created, then waited for until a pod it owns exists;
//  2. single jobs, one at a time: the create call's round trip, and the time
//     from the create returning to the watch's first event of a pod the job
//     owns (apply -> pod on an idle operator);
//  3. the burst: N creates with P in flight, timed the same way per job, and
//     the time from the first create to the last job's first pod.
//
// The operator's peak RSS (VmHWM) is read before it is stopped. Rounds run
// the operators interleaved (A B A B ...), so drift on a shared machine hits
// both; the table gives medians over rounds and the ratio of each figure.
// The harness only creates jobs and watches pods: anything an operator does
// is its own work, counted in the figures.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	watchtools "k8s.io/client-go/tools/watch"
	"sigs.k8s.io/yaml"
)

// operator is one system under test: how to start it on a namespace and what
// one of its jobs looks like.
type operator struct {
	name     string
	resource schema.GroupVersionResource
	kind     string
	// spec of every job (the same object each time, under a new name).
	spec map[string]interface{}
	// command starting the operator scoped to ns.
	command func(ns string) *exec.Cmd
}

type round struct {
	allPods    time.Duration   // first create -> last job's first pod
	burst      []time.Duration // per job: create returned -> first pod event
	single     []time.Duration // the same, one job at a time
	roundTrip  []time.Duration // the single jobs' create calls
	peakRSSKiB int64
	// CPU time per burst job, in ms, of the operator, kube-apiserver and
	// etcd (utime + stime from /proc, around the burst): on 2 cores the
	// burst is bounded by their sum.
	operatorCPUMs, apiserverCPUMs, etcdCPUMs float64
	// API server requests per burst job, by "VERB resource[/sub]", from its
	// apiserver_request_total counters (the harness's own creates removed).
	requests map[string]float64
	// The API server's time per burst job, in ms, by the same keys, from
	// apiserver_request_duration_seconds_sum (the harness's creates kept:
	// they cost the server the same for both operators' jobs).
	serverMs map[string]float64
}

var (
	kubeconfig  = flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "admin kubeconfig of the API server")
	headroom    = flag.String("headroom", "", "headroom-operator binary")
	baseline    = flag.String("headroom-baseline", "", "optional: an older headroom-operator binary, run as a third operator (\"baseline\") for an A/B")
	kubeflow    = flag.String("kubeflow", "", "Kubeflow training-operator.v1 binary")
	headroomJob = flag.String("headroom-job", "", "YAML of the MemoryAwareTrainingJob to create (its spec is used)")
	jobs        = flag.Int("jobs", 500, "jobs in the burst")
	parallel    = flag.Int("parallel", 16, "creates in flight during the burst")
	singles     = flag.Int("singles", 10, "single jobs timed one at a time")
	rounds      = flag.Int("rounds", 3, "rounds per operator, interleaved")
	only        = flag.String("only", "", "run one operator: headroom or kubeflow")
	kfThreads   = flag.Int("kubeflow-threads", 16, "Kubeflow --controller-threads")
	kfQPS       = flag.Int("kubeflow-qps", 1000, "Kubeflow --kube-api-qps (burst: twice this)")
	kfCertNS    = flag.String("kubeflow-cert-namespace", "kubeflow", "namespace of Kubeflow's webhook cert Secret (MY_POD_NAMESPACE)")
	concurrency = flag.Int("headroom-concurrency", 16, "Headroom --concurrency")
	logDir      = flag.String("log-dir", os.TempDir(), "where each operator's output goes")
	timeout     = flag.Duration("timeout", 10*time.Minute, "limit for one round")
)

func main() {
	flag.Parse()
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	check(err, "kubeconfig")
	// The harness must not be the bottleneck: no client-side throttle to
	// speak of.
	cfg.QPS, cfg.Burst = 10000, 20000

	ops := []operator{}
	if *only == "" || *only == "kubeflow" {
		ops = append(ops, kubeflowOperator())
	}
	if *only == "" || *only == "headroom" {
		ops = append(ops, headroomOperator("headroom", *headroom))
		if *baseline != "" {
			ops = append(ops, headroomOperator("baseline", *baseline))
		}
	}
	if len(ops) == 0 {
		fail("-only must be headroom or kubeflow, not %q", *only)
	}

	results := map[string][]round{}
	for r := 1; r <= *rounds; r++ {
		for _, op := range ops {
			ns := fmt.Sprintf("peers-%s-%d-%d", op.name, os.Getpid(), r)
			fmt.Fprintf(os.Stderr, "round %d/%d: %s in %s\n", r, *rounds, op.name, ns)
			res, err := runRound(cfg, op, ns)
			check(err, op.name+" round "+strconv.Itoa(r))
			fmt.Fprintf(os.Stderr, "  all %d pods %.2f s; p50 %d ms, p99 %d ms; single p50 %d ms (create %d ms); peak RSS %.1f MiB\n",
				*jobs, res.allPods.Seconds(), ms(pct(res.burst, 0.5)), ms(pct(res.burst, 0.99)),
				ms(pct(res.single, 0.5)), ms(pct(res.roundTrip, 0.5)), float64(res.peakRSSKiB)/1024)
			results[op.name] = append(results[op.name], res)
		}
	}
	printTable(ops, results)
	printRequests(ops, results)
}

func kubeflowOperator() operator {
	if *kubeflow == "" {
		fail("-kubeflow is required")
	}
	return operator{
		name:     "kubeflow",
		resource: schema.GroupVersionResource{Group: "kubeflow.org", Version: "v1", Resource: "pytorchjobs"},
		kind:     "PyTorchJob",
		spec: map[string]interface{}{
			"pytorchReplicaSpecs": map[string]interface{}{
				"Master": map[string]interface{}{
					"replicas":      int64(1),
					"restartPolicy": "OnFailure",
					"template": map[string]interface{}{
						"spec": map[string]interface{}{
							"containers": []interface{}{map[string]interface{}{
								"name":  "pytorch",
								"image": "localhost/headroom-worker:dev",
								"resources": map[string]interface{}{
									"limits": map[string]interface{}{"memory": "320Mi", "cpu": "1"},
								},
							}},
						},
					},
				},
			},
		},
		command: func(ns string) *exec.Cmd {
			cmd := exec.Command(*kubeflow,
				"--namespace", ns,
				"--enable-scheme", "pytorchjob",
				"--controller-threads", strconv.Itoa(*kfThreads),
				"--kube-api-qps", strconv.Itoa(*kfQPS),
				"--kube-api-burst", strconv.Itoa(2**kfQPS),
				"--metrics-bind-address", "0",
				"--health-probe-bind-address", "0",
				"--webhook-server-port", "19443",
				"--zap-log-level", "error",
				"--kubeconfig", *kubeconfig,
			)
			cmd.Env = append(os.Environ(), "MY_POD_NAMESPACE="+*kfCertNS)
			return cmd
		},
	}
}

func headroomOperator(name, binary string) operator {
	if binary == "" || *headroomJob == "" {
		fail("-headroom and -headroom-job are required")
	}
	raw, err := os.ReadFile(*headroomJob)
	check(err, "reading -headroom-job")
	var job map[string]interface{}
	check(yaml.Unmarshal(raw, &job), "parsing -headroom-job")
	spec, ok := job["spec"].(map[string]interface{})
	if !ok {
		fail("%s has no spec", *headroomJob)
	}
	return operator{
		name:     name,
		resource: schema.GroupVersionResource{Group: "headroom.dev", Version: "v1alpha1", Resource: "memoryawaretrainingjobs"},
		kind:     "MemoryAwareTrainingJob",
		spec:     spec,
		command: func(ns string) *exec.Cmd {
			cmd := exec.Command(binary,
				"--no-leader-election",
				"--watch-namespace", ns,
				"--metrics-addr", "127.0.0.1:0",
				"--concurrency", strconv.Itoa(*concurrency),
			)
			// The worker API as a user's install has it (pods carry its URL
			// and token volume); environment, not flags, so an older
			// -headroom-baseline binary starts with the same command.
			cmd.Env = append(os.Environ(), "RUST_LOG=warn", "KUBECONFIG="+*kubeconfig,
				"HEADROOM_WORKER_API_ADDR=127.0.0.1:0", "HEADROOM_WORKER_API_URL=http://127.0.0.1:9")
			return cmd
		},
	}
}

// podTimes collects, per owning job UID, when the watch first saw a pod.
type podTimes struct {
	mu    sync.Mutex
	first map[types.UID]time.Time
	cond  *sync.Cond
}

func (p *podTimes) seen(uid types.UID, at time.Time) {
	p.mu.Lock()
	if _, ok := p.first[uid]; !ok {
		p.first[uid] = at
		p.cond.Broadcast()
	}
	p.mu.Unlock()
}

// wait blocks until every uid has a pod, or the deadline passes.
func (p *podTimes) wait(uids []types.UID, deadline time.Time) error {
	timer := time.AfterFunc(time.Until(deadline), func() {
		p.mu.Lock()
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	defer timer.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		missing := 0
		for _, u := range uids {
			if _, ok := p.first[u]; !ok {
				missing++
			}
		}
		if missing == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d jobs have no pod after the round's limit", missing, len(uids))
		}
		p.cond.Wait()
	}
}

func (p *podTimes) at(uid types.UID) time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.first[uid]
}

func runRound(cfg *rest.Config, op operator, ns string) (round, error) {
	var res round
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	deadline, _ := ctx.Deadline()
	core := kubernetes.NewForConfigOrDie(cfg)
	dyn := dynamic.NewForConfigOrDie(cfg).Resource(op.resource).Namespace(ns)

	if _, err := core.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return res, fmt.Errorf("namespace: %w", err)
	}
	// The namespace goes at the end, and the round waits until it is gone:
	// deleting 500 jobs and their children keeps the API server busy for
	// a while, and that must not land on the next round.
	defer removeNamespace(core, ns)
	// Kubeflow's pods name the namespace's `default` account. On a cluster
	// kube-controller-manager's serviceaccount controller makes it; the
	// loopback control plane runs without that controller, so the harness
	// makes it, for both operators alike.
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}
	if _, err := core.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return res, fmt.Errorf("the default ServiceAccount: %w", err)
	}

	times := &podTimes{first: map[types.UID]time.Time{}}
	times.cond = sync.NewCond(&times.mu)
	lw := &cache.ListWatch{
		ListFunc: func(o metav1.ListOptions) (runtime.Object, error) {
			return core.CoreV1().Pods(ns).List(ctx, o)
		},
		WatchFunc: func(o metav1.ListOptions) (watch.Interface, error) {
			return core.CoreV1().Pods(ns).Watch(ctx, o)
		},
	}
	list, err := core.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return res, fmt.Errorf("listing pods: %w", err)
	}
	w, err := watchtools.NewRetryWatcherWithContext(ctx, list.ResourceVersion, lw)
	if err != nil {
		return res, fmt.Errorf("watching pods: %w", err)
	}
	defer w.Stop()
	go func() {
		for ev := range w.ResultChan() {
			now := time.Now()
			pod, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			for _, o := range pod.OwnerReferences {
				if o.Controller != nil && *o.Controller {
					times.seen(o.UID, now)
				}
			}
		}
	}()

	logPath := filepath.Join(*logDir, ns+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return res, err
	}
	defer logFile.Close()
	cmd := op.command(ns)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		return res, fmt.Errorf("starting %s: %w", op.name, err)
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}()

	create := func(name string) (types.UID, time.Duration, time.Time, error) {
		obj := &unstructured.Unstructured{Object: map[string]interface{}{
			"apiVersion": op.resource.GroupVersion().String(),
			"kind":       op.kind,
			"metadata":   map[string]interface{}{"name": name},
			"spec":       op.spec,
		}}
		t0 := time.Now()
		made, err := dyn.Create(ctx, obj, metav1.CreateOptions{})
		done := time.Now()
		if err != nil {
			return "", 0, done, fmt.Errorf("creating %s: %w", name, err)
		}
		return made.GetUID(), done.Sub(t0), done, nil
	}

	// 1. Warm-up (also: the operator is up and its caches are synced).
	uid, _, _, err := create("warmup")
	if err != nil {
		return res, err
	}
	if err := times.wait([]types.UID{uid}, deadline); err != nil {
		return res, fmt.Errorf("warm-up job (operator log: %s): %w", logPath, err)
	}

	// 2. Single jobs, one at a time.
	for i := 0; i < *singles; i++ {
		uid, rt, returned, err := create(fmt.Sprintf("single-%02d", i))
		if err != nil {
			return res, err
		}
		if err := times.wait([]types.UID{uid}, deadline); err != nil {
			return res, err
		}
		res.roundTrip = append(res.roundTrip, rt)
		res.single = append(res.single, nonNegative(times.at(uid).Sub(returned)))
	}

	// 3. The burst, with the API server's request counters and the CPU
	// time of the processes that serve it around it.
	before, err := requestCounts(ctx, core)
	if err != nil {
		return res, err
	}
	apiserverPid, etcdPid := pidOf("kube-apiserver"), pidOf("etcd")
	cpu0 := [3]float64{cpuMs(cmd.Process.Pid), cpuMs(apiserverPid), cpuMs(etcdPid)}
	type made struct {
		uid      types.UID
		returned time.Time
	}
	names := make(chan int)
	out := make(chan made, *jobs)
	errs := make(chan error, *parallel)
	var wg sync.WaitGroup
	start := time.Now()
	for p := 0; p < *parallel; p++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range names {
				uid, _, returned, err := create(fmt.Sprintf("job-%04d", i))
				if err != nil {
					errs <- err
					return
				}
				out <- made{uid, returned}
			}
		}()
	}
	for i := 0; i < *jobs; i++ {
		names <- i
	}
	close(names)
	wg.Wait()
	close(out)
	select {
	case err := <-errs:
		return res, err
	default:
	}
	var all []made
	var uids []types.UID
	for m := range out {
		all = append(all, m)
		uids = append(uids, m.uid)
	}
	if err := times.wait(uids, deadline); err != nil {
		return res, fmt.Errorf("burst (operator log: %s): %w", logPath, err)
	}
	var last time.Time
	for _, m := range all {
		at := times.at(m.uid)
		if at.After(last) {
			last = at
		}
		res.burst = append(res.burst, nonNegative(at.Sub(m.returned)))
	}
	res.allPods = last.Sub(start)
	res.peakRSSKiB = vmHWM(cmd.Process.Pid)
	perJob := func(now, then float64) float64 { return (now - then) / float64(*jobs) }
	res.operatorCPUMs = perJob(cpuMs(cmd.Process.Pid), cpu0[0])
	res.apiserverCPUMs = perJob(cpuMs(apiserverPid), cpu0[1])
	res.etcdCPUMs = perJob(cpuMs(etcdPid), cpu0[2])
	after, err := requestCounts(ctx, core)
	if err != nil {
		return res, err
	}
	res.requests = map[string]float64{}
	res.serverMs = map[string]float64{}
	for k, v := range after {
		d := v - before[k]
		if d <= 0 {
			continue
		}
		if key, ok := strings.CutPrefix(k, secondsPrefix); ok {
			res.serverMs[key] = d * 1000 / float64(*jobs)
		} else {
			res.requests[k] = d / float64(*jobs)
		}
	}
	res.requests["POST "+op.resource.Resource] -= 1 // the harness's own create
	if res.requests["POST "+op.resource.Resource] <= 0 {
		delete(res.requests, "POST "+op.resource.Resource)
	}
	return res, nil
}

// secondsPrefix marks, in requestCounts' map, the seconds the API server
// spent on a kind of request rather than how many there were.
const secondsPrefix = "seconds "

// requestCounts reads apiserver_request_total (and, under secondsPrefix,
// apiserver_request_duration_seconds_sum) from the API server's /metrics,
// summed by verb and resource (and subresource). Watches and the harness's
// own reads are few; every figure is over the whole server.
func requestCounts(ctx context.Context, core kubernetes.Interface) (map[string]float64, error) {
	raw, err := core.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("reading the API server's /metrics: %w", err)
	}
	counts := map[string]float64{}
	for _, line := range strings.Split(string(raw), "\n") {
		prefix := ""
		rest, ok := strings.CutPrefix(line, "apiserver_request_total{")
		if !ok {
			if rest, ok = strings.CutPrefix(line, "apiserver_request_duration_seconds_sum{"); !ok {
				continue
			}
			prefix = secondsPrefix
		}
		end := strings.LastIndex(rest, "} ")
		if end < 0 {
			continue
		}
		labels := map[string]string{}
		for _, kv := range strings.Split(rest[:end], ",") {
			if k, v, ok := strings.Cut(kv, "="); ok {
				labels[k] = strings.Trim(v, `"`)
			}
		}
		value, err := strconv.ParseFloat(strings.TrimSpace(rest[end+2:]), 64)
		if err != nil || labels["verb"] == "WATCH" || labels["resource"] == "" {
			continue
		}
		key := prefix + labels["verb"] + " " + labels["resource"]
		if labels["subresource"] != "" {
			key += "/" + labels["subresource"]
		}
		counts[key] += value
	}
	return counts, nil
}

func removeNamespace(core kubernetes.Interface, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	t0 := time.Now()
	if err := core.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		fmt.Fprintf(os.Stderr, "  deleting %s: %v\n", ns, err)
		return
	}
	for ctx.Err() == nil {
		if _, err := core.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); apierrors.IsNotFound(err) {
			fmt.Fprintf(os.Stderr, "  %s deleted in %.1f s\n", ns, time.Since(t0).Seconds())
			return
		}
		time.Sleep(time.Second)
	}
	fmt.Fprintf(os.Stderr, "  %s still there after 10 min; going on\n", ns)
}

func nonNegative(d time.Duration) time.Duration {
	// The watch event can be handled before the create call's goroutine
	// records its return: that pod came with the create, latency zero.
	if d < 0 {
		return 0
	}
	return d
}

// cpuMs is a process's user + system CPU time so far, in ms (0 when it
// cannot be read).
func cpuMs(pid int) float64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil || pid <= 0 {
		return 0
	}
	// Fields after the command name (which may hold spaces): state is the
	// 3rd field of the whole line, utime the 14th, stime the 15th.
	rest := string(raw)
	if i := strings.LastIndex(rest, ") "); i >= 0 {
		rest = rest[i+2:]
	}
	f := strings.Fields(rest)
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseFloat(f[11], 64)
	stime, _ := strconv.ParseFloat(f[12], 64)
	const ticksPerSecond = 100 // USER_HZ on Linux
	return (utime + stime) * 1000 / ticksPerSecond
}

// pidOf finds the process whose command name is `name` (the control plane's
// kube-apiserver, etcd); 0 when there is none.
func pidOf(name string) int {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if err == nil && strings.TrimSpace(string(comm)) == name {
			return pid
		}
	}
	return 0
}

func vmHWM(pid int) int64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kib, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kib
		}
	}
	return 0
}

func pct(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(float64(len(s)-1)*p + 0.5)
	return s[i]
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func ms(d time.Duration) int64 { return d.Milliseconds() }

// printTable prints the markdown table of docs/benchmarks.md: medians over
// rounds (range in brackets), and each other operator's median over
// Headroom's (above 1: Headroom is faster or smaller by that factor).
func printTable(ops []operator, results map[string][]round) {
	type figure struct {
		name  string
		unit  string
		value func(round) float64
	}
	figures := []figure{
		{fmt.Sprintf("all %d pods exist", *jobs), "s", func(r round) float64 { return r.allPods.Seconds() }},
		{"create → pod p50", "ms", func(r round) float64 { return float64(pct(r.burst, 0.5).Microseconds()) / 1000 }},
		{"create → pod p99", "ms", func(r round) float64 { return float64(pct(r.burst, 0.99).Microseconds()) / 1000 }},
		{"single job create → pod p50", "ms", func(r round) float64 { return float64(pct(r.single, 0.5).Microseconds()) / 1000 }},
		{"one create round trip p50", "ms", func(r round) float64 { return float64(pct(r.roundTrip, 0.5).Microseconds()) / 1000 }},
		{"operator peak RSS", "MiB", func(r round) float64 { return float64(r.peakRSSKiB) / 1024 }},
		{"operator CPU per burst job", "ms", func(r round) float64 { return r.operatorCPUMs }},
		{"kube-apiserver CPU per burst job", "ms", func(r round) float64 { return r.apiserverCPUMs }},
		{"etcd CPU per burst job", "ms", func(r round) float64 { return r.etcdCPUMs }},
	}
	fmt.Printf("\n%d jobs, %d in flight; %d single jobs; medians of %d interleaved rounds (range)\n\n", *jobs, *parallel, *singles, *rounds)
	header := "| figure |"
	rule := "|---|"
	for _, op := range ops {
		header += " " + op.name + " |"
		rule += "---|"
	}
	var others []int
	for i, op := range ops {
		if op.name != "headroom" && len(ops) > 1 {
			others = append(others, i)
			header += " " + op.name + " / headroom |"
			rule += "---|"
		}
	}
	fmt.Println(header)
	fmt.Println(rule)
	for _, f := range figures {
		line := "| " + f.name + " |"
		meds := map[string]float64{}
		for _, op := range ops {
			var xs []float64
			for _, r := range results[op.name] {
				xs = append(xs, f.value(r))
			}
			m := median(xs)
			meds[op.name] = m
			s := append([]float64(nil), xs...)
			sort.Float64s(s)
			line += fmt.Sprintf(" %s %s (%s–%s) |", num(m), f.unit, num(s[0]), num(s[len(s)-1]))
		}
		for _, i := range others {
			if h := meds["headroom"]; h > 0 {
				line += fmt.Sprintf(" %.2f |", meds[ops[i].name]/h)
			} else {
				line += " – |"
			}
		}
		fmt.Println(line)
	}
}

// printRequests prints, per operator, the API server requests per burst job
// (median over rounds) that are at least 0.05 a job.
func printRequests(ops []operator, results map[string][]round) {
	fmt.Printf("\nAPI server requests per job during the burst (median of rounds; watches and the harness's creates left out)\n\n")
	for _, op := range ops {
		var parts []string
		var writes, total float64
		for _, km := range medians(results[op.name], func(r round) map[string]float64 { return r.requests }) {
			total += km.value
			if !strings.HasPrefix(km.key, "GET ") && !strings.HasPrefix(km.key, "LIST ") {
				writes += km.value
			}
			parts = append(parts, fmt.Sprintf("%s %.2f", km.key, km.value))
		}
		fmt.Printf("- %s: %.2f writes, %.2f requests: %s\n", op.name, writes, total, strings.Join(parts, ", "))
	}
	fmt.Printf("\nAPI server time per job during the burst, ms (median of rounds; the harness's creates included, watches left out)\n\n")
	for _, op := range ops {
		var parts []string
		var total float64
		for _, km := range medians(results[op.name], func(r round) map[string]float64 { return r.serverMs }) {
			total += km.value
			parts = append(parts, fmt.Sprintf("%s %.2f", km.key, km.value))
		}
		fmt.Printf("- %s: %.2f ms: %s\n", op.name, total, strings.Join(parts, ", "))
	}
}

type keyedMedian struct {
	key   string
	value float64
}

// medians is, per key of the rounds' maps (sorted), the median over rounds
// (a round without the key counts 0), leaving out those under 0.05.
func medians(rounds []round, pick func(round) map[string]float64) []keyedMedian {
	keys := map[string]bool{}
	for _, r := range rounds {
		for k := range pick(r) {
			keys[k] = true
		}
	}
	var names []string
	for k := range keys {
		names = append(names, k)
	}
	sort.Strings(names)
	var out []keyedMedian
	for _, k := range names {
		var xs []float64
		for _, r := range rounds {
			xs = append(xs, pick(r)[k])
		}
		if m := median(xs); m >= 0.05 {
			out = append(out, keyedMedian{k, m})
		}
	}
	return out
}

func num(x float64) string {
	if x >= 100 {
		return strconv.FormatFloat(x, 'f', 0, 64)
	}
	if x >= 10 {
		return strconv.FormatFloat(x, 'f', 1, 64)
	}
	return strconv.FormatFloat(x, 'f', 2, 64)
}

func check(err error, what string) {
	if err != nil {
		fail("%s: %v", what, err)
	}
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "peers: "+format+"\n", args...)
	os.Exit(1)
}
