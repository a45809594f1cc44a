# shellcheck shell=bash
# Pod network: Debian's containernetworking-plugins (bridge + host-local +
# portmap; containerd adds loopback itself). One bridge on the host, pods get
# $POD_CIDR addresses, the bridge IP is their gateway, traffic leaving the pod
# range is masqueraded. The config and host-local's allocations live in the
# state dir, not in /etc/cni and /var/lib/cni.

cni_write_config() {
  local p
  mkdir -p "${CNI_CONF_DIR}" "${CNI_IPAM_DIR}"
  for p in bridge host-local loopback portmap; do
    [[ -x ${CNI_BIN_DIR}/${p} ]] || die "CNI plugin ${CNI_BIN_DIR}/${p} missing (apt-get install containernetworking-plugins)"
  done
  cat >"${CNI_CONF_DIR}/10-headroom.conflist.tmp" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "headroom",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "${CNI_BRIDGE}",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "${CNI_IPAM_DIR}",
        "ranges": [[{"subnet": "${POD_CIDR}"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
  mv -f "${CNI_CONF_DIR}/10-headroom.conflist.tmp" "${CNI_CONF_DIR}/10-headroom.conflist"
}

# Host settings pods need: forwarding between the bridge and the host, and
# bridged traffic passing iptables (so kube-proxy's Service DNAT applies to
# pod-to-pod traffic on the same bridge). Both are global and are left on.
node_sysctls() {
  local k v kv cur
  # Built into this VM's kernel; modules on stock Debian kernels.
  [[ -d /proc/sys/net/bridge ]] || modprobe br_netfilter 2>/dev/null || true
  grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || true
  for kv in net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1; do
    k=${kv%%=*} v=${kv#*=}
    cur=$(sysctl -n "${k}" 2>/dev/null) || die "sysctl ${k} unavailable (br_netfilter not loaded? modprobe br_netfilter)"
    [[ ${cur} == "${v}" ]] && continue
    sysctl -q -w "${kv}" >/dev/null || die "cannot set ${kv}"
    log "set ${kv} (was ${cur})"
  done
}
